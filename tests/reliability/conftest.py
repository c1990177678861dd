"""The reliability suite: every case where dmuon must fail loudly instead of corrupting weights
silently or hanging, in one folder (issue 14). Distributed cases run under a process-group
timeout and a scenario deadline, so a regression fails the test instead of hanging CI.

- ``test_gradient_semantics.py``: the owners' master gradients follow torch's rules (a skipped
  step, NaN-skip, never zeroing, ``set_to_none=False``, micro-batches), ``nonfinite=`` in one
  process, a low-precision compute dtype without FSDP2's mixed precision warns;
- ``test_nonfinite.py``: a NaN on one rank only is skipped / raised / refused by clipping on every
  rank alike;
- ``test_hyperparameters.py``: bad values refused with the value; a value that differs on one
  rank fails on every rank;
- ``test_setup_failures.py``: a ``dedicate_params`` error on some ranks is raised on every rank
  before any process group exists;
- ``test_timeouts.py``: the groups dmuon creates inherit the timeout; a stalled peer fails the
  others within it, naming dmuon's collective;
- ``test_rank_death.py`` (with ``rank_death.py``): a rank that dies in forward or after backward
  makes the others fail, not hang;
- ``test_env_flags.py`` (dmuon-kernels alone) and ``test_forward_profile_flag.py``: the one on/off
  parser of ``DMUON_*`` variables, and a value that is neither raises naming the variable;
- ``test_seed_messages.py``: every message and recipe of the seed's troubleshooting page (it names
  the protocol tests that cover its multi-rank entries).

Scenarios run on the session's gloo pools (``tests/conftest.py``) from ``scenarios_*.py`` here.
"""
