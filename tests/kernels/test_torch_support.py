"""Importing on a torch older than the oldest tested one fails with the version and the fix."""

import pytest

from dmuon_kernels._torch_support import require_torch


@pytest.mark.parametrize("version", ["2.10.1", "2.4.0+cu121", "1.13.1"])
def test_an_older_torch_raises_import_error_naming_the_required_version(version):
    with pytest.raises(ImportError) as error:
        require_torch("dmuon-core", version)
    message = str(error.value)
    assert "dmuon-core requires torch>=2.11" in message
    assert f"torch {version} is installed" in message
    assert "pip install 'torch>=2.11'" in message


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "3.0.0"])
def test_supported_torch_versions_import(version):
    require_torch("dmuon-kernels", version)
