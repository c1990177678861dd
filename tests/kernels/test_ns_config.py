"""NewtonSchulz configuration: argument validation, kernel resolution, the request config,
the status reports and the rank-tagged logger. Every user-facing message is asserted."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from dmuon_kernels import (
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    NewtonSchulz,
    get_backend_status,
    get_ns_backend,
    log_rank_tagged,
    newton_schulz,
)
from dmuon_kernels.syrk import backend_availability

CPU_ONLY = not torch.cuda.is_available()
needs_cpu_only = pytest.mark.skipif(not CPU_ONLY, reason="describes the CPU-only report")


@pytest.fixture(autouse=True)
def _no_kernel_override(monkeypatch):
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)


def _skip_if_available(name):
    if backend_availability(name)[0]:
        pytest.skip(f"{name} is available on this machine")


# --- argument validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "svd"}, r"backend must be 'gram' or 'direct'; got 'svd'"),
        (
            {"dtype": torch.float64},
            r"dtype \(the iteration dtype\) must be None \(fp16 on CUDA, fp32 elsewhere\), "
            r"torch.float16, torch.bfloat16 or torch.float32; got torch.float64",
        ),
        ({"coefficients": []}, r"coefficients is empty: give at least one \(a, b, c\) row"),
        (
            {"coefficients": [(3.4, -4.7, 2.0), (1.0, 2.0)]},
            r"coefficients row 1 must have exactly 3 values \(a, b, c\); got \(1.0, 2.0\)",
        ),
        ({"coefficients": [(1.0, "b", 2.0)]}, r"coefficients row 0 must hold real numbers"),
        ({"coefficients": [(1.0, float("nan"), 2.0)]}, r"coefficients row 0 must be finite"),
        ({"coefficients": "keller"}, r"coefficients must be a sequence of \(a, b, c\) rows"),
        (
            {"restart_iterations": [5]},
            r"restart_iterations index 5 is out of range: with 5 coefficient rows the gram "
            r"backend can restart before iterations 1..4 \(iteration 0 always starts a segment\)",
        ),
        ({"restart_iterations": [0]}, r"restart_iterations index 0 is out of range"),
        ({"restart_iterations": [2.0]}, r"restart_iterations must hold ints .*; got 2.0"),
        ({"restart_iterations": 2}, r"restart_iterations must be a sequence of 0-based"),
        (
            {"kernel": "triton"},
            r"kernel must be one of 'auto', 'cublas', 'quack', 'cute', 'cute_sm80'; "
            r"got 'triton'",
        ),
        ({"deterministic": "yes"}, r"deterministic must be True or False; got 'yes'"),
    ],
    ids=lambda value: str(value)[:40],
)
def test_invalid_arguments_raise_a_precise_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NewtonSchulz(**kwargs)
    if "deterministic" not in kwargs:
        with pytest.raises(ValueError, match=message):
            newton_schulz(torch.ones(4, 8), **kwargs)


@pytest.mark.parametrize(
    ("G", "message"),
    [
        (torch.ones(8), r"expects a floating-point matrix \(m, n\) .* got a 1-D torch.float32"),
        (torch.ones(4, 8, dtype=torch.int32), r"got a 2-D torch.int32 tensor of shape \(4, 8\)"),
        ([[1.0, 2.0]], r"newton_schulz expects a torch.Tensor; got list"),
    ],
    ids=["1d", "int", "list"],
)
def test_inputs_that_are_not_floating_matrices_are_rejected(G, message):
    with pytest.raises(ValueError, match=message):
        newton_schulz(G)
    with pytest.raises(ValueError, match=message):
        NewtonSchulz()(G)


def test_negative_eps_is_rejected():
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0; got -1e-07"):
        newton_schulz(torch.ones(4, 8), eps=-1e-7)


def test_default_restart_is_before_iteration_two_and_short_tables_get_none():
    assert NewtonSchulz().restart_iterations == (2,)
    assert NewtonSchulz(coefficients=KELLER_COEFFICIENTS[:2]).restart_iterations == ()
    assert NewtonSchulz(restart_iterations=[3, 1, 3]).restart_iterations == (1, 3)


# --- kernel resolution --------------------------------------------------------------------------


def test_kernel_cublas_is_the_same_request_as_deterministic():
    by_kernel = NewtonSchulz(kernel="cublas")
    by_flag = NewtonSchulz(deterministic=True)
    assert by_kernel.kernel == by_flag.kernel == "cublas"
    assert by_kernel.deterministic and by_flag.deterministic


@needs_cpu_only
def test_auto_resolves_to_the_torch_fallback_on_cpu():
    ns = NewtonSchulz()
    assert (ns.requested_kernel, ns.kernel, ns.kernel_origin) == ("auto", "cublas", "auto")


@pytest.mark.parametrize("kernel", ["quack", "cute_sm80"])
def test_an_explicit_kernel_that_cannot_run_fails_at_construction_with_a_hint(kernel):
    name = "cute" if kernel == "cute_sm80" else kernel
    _skip_if_available(name)
    with pytest.raises(RuntimeError) as raised:
        NewtonSchulz(kernel=kernel)
    message = str(raised.value)
    assert f"kernel={name!r} cannot run here" in message
    assert f"pip install dmuon-kernels[{name}]" in message
    assert 'use kernel="auto"' in message


def test_invalid_env_kernel_names_the_variable_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv("DMUON_NS_KERNEL", "fastest")
    with pytest.raises(
        ValueError,
        match=r"environment variable DMUON_NS_KERNEL must be one of 'auto', 'cublas', 'quack', "
        r"'cute', 'cute_sm80'; got 'fastest'",
    ):
        NewtonSchulz()


def test_env_kernel_decides_when_the_argument_is_auto(monkeypatch):
    monkeypatch.setenv("DMUON_NS_KERNEL", "cublas")
    ns = NewtonSchulz()
    assert (ns.kernel, ns.kernel_origin) == ("cublas", "DMUON_NS_KERNEL")
    assert "set by DMUON_NS_KERNEL" in get_ns_backend(ns)


def test_an_explicit_kernel_argument_beats_the_env_variable(monkeypatch):
    monkeypatch.setenv("DMUON_NS_KERNEL", "quack")
    ns = NewtonSchulz(kernel="cublas")
    assert (ns.kernel, ns.kernel_origin) == ("cublas", "kernel argument")


def test_env_auto_leaves_the_decision_to_deterministic(monkeypatch):
    monkeypatch.setenv("DMUON_NS_KERNEL", "auto")
    ns = NewtonSchulz(deterministic=True)
    assert (ns.kernel, ns.kernel_origin) == ("cublas", "deterministic=True")


def test_an_env_kernel_that_cannot_run_fails_at_construction_naming_the_variable(monkeypatch):
    _skip_if_available("quack")
    monkeypatch.setenv("DMUON_NS_KERNEL", "quack")
    with pytest.raises(RuntimeError) as raised:
        NewtonSchulz()
    message = str(raised.value)
    assert "DMUON_NS_KERNEL='quack' cannot run here" in message
    assert "pip install dmuon-kernels[quack]" in message
    assert "set DMUON_NS_KERNEL=auto (or unset it)" in message


def test_env_kernel_also_steers_the_function_form(monkeypatch):
    _skip_if_available("quack")
    monkeypatch.setenv("DMUON_NS_KERNEL", "quack")
    with pytest.raises(RuntimeError, match=r"DMUON_NS_KERNEL='quack' cannot run here"):
        newton_schulz(torch.ones(4, 8))


# --- the request config -------------------------------------------------------------------------


def test_config_is_hashable_json_able_and_equal_for_equal_requests():
    first = NewtonSchulz("gram", restart_iterations=[2], dtype=None).config
    second = NewtonSchulz().config
    assert first == second and hash(first) == hash(second)
    assert first.to_json() == second.to_json()
    decoded = json.loads(first.to_json())
    assert decoded == {
        "backend": "gram",
        "kernel": "auto",
        "deterministic": False,
        "coefficients": [list(row) for row in POLAR_EXPRESS_COEFFICIENTS],
        "restart_iterations": [2],
        "dtype": "auto",
    }
    assert NewtonSchulz(dtype=torch.float16).config != first  # fp16 everywhere is another request


def test_config_differences_name_each_differing_field():
    mine = NewtonSchulz().config
    theirs = NewtonSchulz("direct", coefficients=KELLER_COEFFICIENTS, dtype=torch.bfloat16).config
    assert mine != theirs
    assert set(mine.differences(theirs)) == {"backend", "coefficients", "dtype"}
    assert mine.differences(theirs)["dtype"] == ("auto", "bfloat16")


def test_config_records_the_request_not_the_resolution(monkeypatch):
    plain = NewtonSchulz().config
    monkeypatch.setenv("DMUON_NS_KERNEL", "cublas")
    overridden = NewtonSchulz()
    assert overridden.kernel == "cublas"
    assert overridden.config == plain  # same request, whatever this machine resolves it to


# --- reports ------------------------------------------------------------------------------------


@needs_cpu_only
def test_get_ns_backend_names_the_form_and_the_kernel_that_runs_on_cpu():
    assert get_ns_backend() == "Gram NS · kernel=cublas (CPU, torch fallback)"
    assert (
        get_ns_backend(NewtonSchulz("direct")) == "Direct NS · kernel=cublas (CPU, torch fallback)"
    )
    assert (
        get_ns_backend(NewtonSchulz(deterministic=True, dtype=torch.float32))
        == "Gram NS · kernel=cublas (CPU, torch fallback; deterministic=True; float32 iteration)"
    )


def test_backend_status_reports_every_backend_env_and_versions(monkeypatch):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_LOG", "0")
    status = get_backend_status()
    json.dumps(status)  # JSON-friendly
    assert set(status["backends"]) >= {"cublas", "quack", "cute"}
    assert status["backends"]["cublas"]["available"] is True
    for entry in status["backends"].values():
        assert isinstance(entry["available"], bool) and entry["reason"]
    assert status["env"]["DMUON_SYRK_AUTOTUNE_LOG"] == "0"
    assert status["env"]["DMUON_NS_KERNEL"] is None
    assert status["versions"]["torch"] == torch.__version__
    assert status["versions"]["dmuon-kernels"] is not None
    if CPU_ONLY:
        assert (status["sm"], status["auto_choice"]) == (None, "cublas")


def test_backend_status_says_when_the_kernel_folder_is_not_used_and_why(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DMUON_KERNEL_CACHE", raising=False)
    folder = tmp_path / "kernels"
    assert get_backend_status()["kernel_cache"] == {
        "folder": str(folder),
        "enabled": True,
        "problem": None,
    }
    folder.mkdir(mode=0o700)
    folder.chmod(0o775)
    report = get_backend_status()["kernel_cache"]
    assert report["problem"] == "its group can write it (mode 0775)"
    monkeypatch.setenv("DMUON_KERNEL_CACHE", "0")
    assert get_backend_status()["kernel_cache"]["enabled"] is False


def test_backend_status_reports_what_newton_schulz_runs():
    ns_report = get_backend_status()["ns"]
    assert ns_report == {
        "requested": "auto",
        "origin": "auto",
        "backend": get_ns_backend(),
        "error": None,
    }


@pytest.mark.parametrize("name", ["quack", "cute"])
def test_get_ns_backend_raises_what_newton_schulz_raises_for_an_env_kernel_that_cannot_run(
    monkeypatch, name
):
    _skip_if_available(name)
    monkeypatch.setenv("DMUON_NS_KERNEL", name)
    with pytest.raises(RuntimeError) as from_constructor:
        NewtonSchulz()
    with pytest.raises(RuntimeError) as from_report:
        get_ns_backend()
    message = str(from_report.value)
    assert message == str(from_constructor.value)
    assert f"DMUON_NS_KERNEL={name!r} cannot run here" in message
    assert f"pip install dmuon-kernels[{name}]" in message
    assert "set DMUON_NS_KERNEL=auto (or unset it)" in message


@pytest.mark.parametrize("name", ["quack", "cute"])
def test_backend_status_reports_an_env_kernel_that_cannot_run_instead_of_raising(monkeypatch, name):
    _skip_if_available(name)
    monkeypatch.setenv("DMUON_NS_KERNEL", name)
    status = get_backend_status()
    json.dumps(status)
    with pytest.raises(RuntimeError) as raised:
        NewtonSchulz()
    assert status["ns"] == {
        "requested": name,
        "origin": "DMUON_NS_KERNEL",
        "backend": None,
        "error": str(raised.value),
    }
    assert status["env"]["DMUON_NS_KERNEL"] == name
    assert status["backends"][name]["available"] is False
    assert status["backends"][name]["reason"] in status["ns"]["error"]


def test_backend_status_reports_an_env_value_that_names_no_kernel_instead_of_raising(
    monkeypatch,
):
    monkeypatch.setenv("DMUON_NS_KERNEL", "fastest")
    status = get_backend_status()
    assert status["ns"] == {
        "requested": None,
        "origin": "DMUON_NS_KERNEL",
        "backend": None,
        "error": "environment variable DMUON_NS_KERNEL must be one of 'auto', 'cublas', 'quack', "
        "'cute', 'cute_sm80'; got 'fastest'",
    }
    with pytest.raises(ValueError, match=r"DMUON_NS_KERNEL must be one of .* got 'fastest'"):
        get_ns_backend()


def test_backend_status_reports_an_invalid_cuda_graph_switch_instead_of_raising(monkeypatch):
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "sometimes")
    ns_report = get_backend_status()["ns"]
    assert (ns_report["requested"], ns_report["backend"]) == ("auto", None)
    assert ns_report["error"].startswith(
        "environment variable DMUON_NS_CUDA_GRAPH='sometimes' is not an on/off value"
    )


# --- rank-tagged logging ------------------------------------------------------------------------


def test_log_lines_are_tagged_with_rank_and_world_size_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with caplog.at_level(logging.INFO, logger="dmuon_kernels"):
        log_rank_tagged("SYRK autotune candidate started shape=(4096,14336)")
    assert caplog.messages == [
        "[DMuon][rank=3/8] SYRK autotune candidate started shape=(4096,14336)"
    ]


def test_log_tag_defaults_to_rank_zero_of_one(monkeypatch, caplog):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="dmuon_kernels"):
        log_rank_tagged("hello")
    assert caplog.messages == ["[DMuon][rank=0/1] hello"]


def test_log_lines_reach_stderr_without_any_logging_setup():
    script = "from dmuon_kernels import log_rank_tagged; log_rank_tagged('autotune verdict')"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"RANK": "1", "WORLD_SIZE": "2", "PATH": ""},
    )
    assert result.stderr == "[DMuon][rank=1/2] autotune verdict\n"
