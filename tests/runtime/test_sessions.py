"""ONNX Runtime provider choice: CUDA only when it can be had, and always reported."""

from __future__ import annotations

import pytest

from trainyard.core.errors import ProviderError
from trainyard.runtime.sessions import CPU, CUDA, choose_providers, cuda_device_count

from conftest import has_cuda


@pytest.mark.skipif(has_cuda(), reason="checks the no-GPU path")
def test_no_gpu_means_cpu_and_cuda_request_is_a_clear_error():
    assert cuda_device_count() == 0
    assert choose_providers("auto") == [CPU]
    assert choose_providers("cpu") == [CPU]
    with pytest.raises(ProviderError, match="device 'cuda' asked for, but"):
        choose_providers("cuda")


@pytest.mark.gpu
def test_gpu_present_means_cuda_first():
    import onnxruntime as ort

    if CUDA not in ort.get_available_providers():
        pytest.skip("onnxruntime without the CUDA provider")
    assert choose_providers("auto") == [CUDA, CPU]
    assert choose_providers("cpu") == [CPU]
