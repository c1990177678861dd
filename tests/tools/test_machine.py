"""``dmuon_tools.machine``: a machine survives JSON, bad files are refused naming the key and the
fix, and a group's link is the link class its ranks use."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dmuon_tools.machine import H200, Link, Machine, load_machine


def test_a_machine_survives_its_json():
    data = json.loads(json.dumps(H200.to_json()))
    assert Machine.from_json(data) == H200
    assert data["ns_ms"]["4096x14336"] == H200.ns_ms[(4096, 14336)]


def test_every_figure_of_the_h200_preset_says_where_it_comes_from():
    figures = {f.name for f in dataclasses.fields(Machine)} - {"name", "gpu", "sources"}
    assert figures <= set(H200.sources)
    assert H200.sources["nvlink"].startswith("assumed:")
    assert H200.sources["network"].startswith("assumed:")


def test_load_machine_reads_a_preset_or_a_file(tmp_path):
    assert load_machine("H200") is H200
    path = tmp_path / "cluster.json"
    slow = dataclasses.replace(H200, name="cluster", network=Link(bandwidth_gbps=5, latency_us=20))
    path.write_text(json.dumps(slow.to_json()))
    assert load_machine(str(path)) == slow


def test_an_unknown_machine_names_the_presets():
    with pytest.raises(ValueError, match=r"--machine 'b200' is neither a file nor a preset\. "
                       r"Presets: h200"):  # fmt: skip
        load_machine("b200")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("copy_gbps"), "missing copy_gbps"),
        (lambda d: d.update(nics=8), "unknown keys nics"),
        (lambda d: d.update(copy_gbps=-1), "copy_gbps must be a finite number > 0, got -1.0"),
        (lambda d: d.update(copy_gbps="fast"), "copy_gbps: expected a number, got 'fast'"),
        (lambda d: d.update(ns_ms={}), "ns_ms is empty"),
        (lambda d: d.update(ns_ms={"4096": 1.0}), "'4096' is not a shape 'MxN'"),
        (lambda d: d.update(network={"bandwidth_gbps": 45}), "network must be an object with"),
        (
            lambda d: d.update(layer_host_ms={"deepspeed": 1.0}),
            r"layer_host_ms has \['deepspeed'\]; its keys are fsdp2, dmuon",
        ),
    ],
)
def test_a_bad_machine_file_is_refused_naming_the_key(tmp_path, edit, message):
    data = H200.to_json()
    edit(data)
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        Machine.load(path)


def test_a_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "machine.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="cannot read the machine file"):
        Machine.load(path)


def test_a_group_across_nodes_runs_one_ring_per_nic_of_its_ranks_in_a_node_up_to_nvlink():
    assert H200.group_link("nvlink", 8) == H200.nvlink
    one_nic = H200.group_link("network", 1)
    assert one_nic.bandwidth_gbps == H200.network.bandwidth_gbps
    assert one_nic.latency_us == H200.network.latency_us
    assert H200.group_link("network", 4).bandwidth_gbps == 4 * H200.network.bandwidth_gbps
    assert H200.group_link("network", 8).bandwidth_gbps == H200.nvlink.bandwidth_gbps
