"""lmstack speculator `ngram`: drafts the tokens that followed the latest earlier occurrence of
the sequence's longest matching suffix (prompt lookup decoding)."""

from lmstack_ngram.index import NgramIndex
from lmstack_ngram.speculator import NgramOptions, NgramSpeculator

__all__ = ["NgramIndex", "NgramOptions", "NgramSpeculator"]
