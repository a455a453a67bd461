"""The protocol kinds, one module each: its suite keys (a pydantic dataclass) and its run. Importing this
package registers them all (`ssl_vit.evaluation.protocol.PROTOCOLS`)."""

# The order kinds are listed in, as `kind:`'s valid values and in docs/SUITES.md: frozen features first.
# isort: off
from ssl_vit.evaluation.kinds.fewshot_protocol import FewShotProtocol
from ssl_vit.evaluation.kinds.knn_protocol import KNNProtocol
from ssl_vit.evaluation.kinds.linear_probe_protocol import LinearProbeProtocol
from ssl_vit.evaluation.kinds.attentive_probe_protocol import AttentiveProbeProtocol
from ssl_vit.evaluation.kinds.linear_seg_protocol import LinearSegProtocol
from ssl_vit.evaluation.kinds.finetune_protocol import FineTuneProtocol

# isort: on

__all__ = [
    "AttentiveProbeProtocol", "FewShotProtocol", "FineTuneProtocol", "KNNProtocol", "LinearProbeProtocol",
    "LinearSegProtocol",
]  # fmt: skip
