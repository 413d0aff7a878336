"""The int8 model of a registered version (``export.quantize: int8``) in MLflow.

The export stage logs models/model.int8.onnx into the train run under ``INT8_ARTIFACT``;
evaluate registers the fp32 model as the version and puts the int8 file's sha256, where it
is and its gate's figures in the version's own tags, in the same write that creates it
(``int8_tags``), so a service following an alias never sees the version without them.
``MlflowRegistry.fetch_int8`` (track.model_refs) is what ``serve.precision: int8`` with a
``models:/`` source downloads, checked against that sha256 as the fp32 file is against
``onnx_sha256``.
"""

from __future__ import annotations

from trainyard.core.handoffs import Int8Export
from trainyard.runtime.model_file import INT8_SUFFIX

INT8_FOLDER = "int8"  # the train run's artifact folder
INT8_ARTIFACT = f"{INT8_FOLDER}/model{INT8_SUFFIX}"
INT8_SHA_TAG, INT8_ARTIFACT_TAG = "int8_sha256", "int8.artifact"


def int8_tags(int8: Int8Export) -> dict[str, str]:
    """The version's tags for its int8 file: sha256, artifact, and the gate's figures."""
    return {
        INT8_SHA_TAG: int8.sha256,
        INT8_ARTIFACT_TAG: int8.artifact,
        "int8.agreement": f"{int8.agreement:.6f}",
        "int8.accuracy_drop": f"{int8.accuracy_drop:.4f}",  # percentage points
        "int8.accuracy": f"{int8.accuracy_int8:.6f}",
    }
