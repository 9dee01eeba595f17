"""lmstack speculator `eagle`: an EAGLE-1 draft head (fc + one decoder layer) over the target's
final hidden states, reusing the target's embedding and LM head; `lmstack eagle train` builds a
head by self-distillation."""

from lmstack_eagle.head import EagleHead, HeadConfig, load_head, save_head
from lmstack_eagle.speculator import EagleOptions, EagleSpeculator

__all__ = ["EagleHead", "EagleOptions", "EagleSpeculator", "HeadConfig", "load_head", "save_head"]
