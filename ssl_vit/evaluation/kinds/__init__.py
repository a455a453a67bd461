"""The protocol kinds, one module each: its suite keys (a pydantic dataclass) and its run. Importing this
package registers them all (`ssl_vit.evaluation.protocol.PROTOCOLS`), in the order docs/SUITES.md lists
them."""

# The order kinds are listed in, as `kind:`'s valid values: frozen features first.
# isort: off
from ssl_vit.evaluation.kinds.fewshot import FewShotProtocol
from ssl_vit.evaluation.kinds.knn import KNNProtocol
from ssl_vit.evaluation.kinds.linear_probe import LinearProbeProtocol
from ssl_vit.evaluation.kinds.attentive_probe import AttentiveProbeProtocol
from ssl_vit.evaluation.kinds.linear_seg import LinearSegProtocol
from ssl_vit.evaluation.kinds.finetune import FineTuneProtocol

# isort: on

__all__ = [
    "AttentiveProbeProtocol", "FewShotProtocol", "FineTuneProtocol", "KNNProtocol", "LinearProbeProtocol",
    "LinearSegProtocol",
]  # fmt: skip
