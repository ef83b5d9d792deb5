"""EAGLE: a one-layer draft head that autoregresses the target's top-layer features.

``head`` (the module), ``drafter`` (the Drafter implementation), ``checkpoint`` (save/load bound to
one target), and the training pipeline: ``corpus`` -> ``extract`` (target features) -> ``train``.
"""

from verispec.drafters.eagle.checkpoint import EagleHeadMismatchError, default_head_path, existing_head_path, load_head, save_head, target_fingerprint
from verispec.drafters.eagle.drafter import EagleDrafter
from verispec.drafters.eagle.head import EagleConfig, EagleHead

__all__ = [
    "EagleConfig",
    "EagleDrafter",
    "EagleHead",
    "EagleHeadMismatchError",
    "default_head_path",
    "existing_head_path",
    "load_head",
    "save_head",
    "target_fingerprint",
]
