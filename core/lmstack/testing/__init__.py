"""Conformance kits: reusable pytest checks every component must pass, built-in or
third-party — one kit per kind. A kit tests the *registered* component: it builds it through
its factory with options converted through its options type, reads its declared capabilities
and tests exactly those.

Subclass the kit in your plugin's test module and name the component::

    from lmstack.testing import SchedulerConformance

    class TestMyScheduler(SchedulerConformance):
        component = "mine"                 # a registered name, or the Component object
        options = {"max_num_seqs": 8}      # optional

Kits: `SchedulerConformance`, `AllocatorConformance`, `AttentionConformance`,
`QuantizerConformance`, `SpeculatorConformance`, `ParallelConformance`, and for lmstack-api's
tool-call parsers `ToolParserConformance` (a parser class and a corpus, no engine). The end-to-end checks
run the real engine on a tiny random-weight Llama written without downloads: the fixture
`tiny_model_path` (`lmstack.testing.fixtures`, loaded automatically by pytest where lmstack is
installed), or `lmstack.testing.tiny_model.write_tiny_model(path)` directly. To build a
component as the engine would outside a kit: `lmstack.testing.components.build_component`.
"""

from lmstack.testing.allocator import AllocatorConformance
from lmstack.testing.attention import AttentionConformance, paged_batch, plain_attention, reference_attention
from lmstack.testing.cache import CacheConformance
from lmstack.testing.components import build_component
from lmstack.testing.fakes import make_seq
from lmstack.testing.kit import ComponentKit
from lmstack.testing.parallel import ParallelConformance
from lmstack.testing.quantizer import QuantizerConformance
from lmstack.testing.scheduler import SchedulerConformance, simulate
from lmstack.testing.speculator import SpeculatorConformance
from lmstack.testing.tiny_model import write_tiny_model
from lmstack.testing.tool_parsers import ToolParserConformance

__all__ = [
    "AllocatorConformance",
    "AttentionConformance",
    "CacheConformance",
    "ComponentKit",
    "ParallelConformance",
    "QuantizerConformance",
    "SchedulerConformance",
    "SpeculatorConformance",
    "ToolParserConformance",
    "build_component",
    "make_seq",
    "paged_batch",
    "plain_attention",
    "reference_attention",
    "simulate",
    "write_tiny_model",
]
