"""StreamingLLM for transformers ≥ 5: attention sinks + a sliding window with positions by cache slot."""

from .cache import SinkCache
from .session import StreamSession, stream_generate
from .state import StreamState

__all__ = ["SinkCache", "StreamSession", "StreamState", "stream_generate"]
