"""dmuon-titan with torchtitan's asynchronous checkpoints (``--checkpoint.async_mode async``,
issue 43 item 7): saved while training goes on, a run resumed from one continues bit for bit like
the uninterrupted run."""

from tests.titan.scenarios_titan_async import train_with_async_checkpoints

SAVING = {"steps": 4, "ns": "fp32", "checkpoint_folder": "ckpt", "checkpoint_interval": 2}


def test_a_run_resumed_from_an_async_checkpoint_continues_bit_for_bit(pool2, tmp_path):
    root = str(tmp_path)
    run = pool2.run(train_with_async_checkpoints, job_options=SAVING, checkpoint_root=root)[0]
    resumed = pool2.run(
        train_with_async_checkpoints,
        job_options={**SAVING, "load_step": 2},
        checkpoint_root=root,
    )[0]
    assert resumed["first_step"] == 3
    assert resumed["logged"] == run["logged"][2:]
    assert resumed["final"].keys() == run["final"].keys()
    different = [k for k, v in resumed["final"].items() if not (v == run["final"][k]).all()]
    assert not different, different
