"""StreamingLLM for transformers ≥ 5: attention sinks + a sliding window with positions by cache slot."""

from .cache import SinkCache
from .config import StreamConfig
from .session import StreamSession, stream_generate
from .state import StreamState

__all__ = ["SinkCache", "StreamConfig", "StreamSession", "StreamState", "stream_generate"]
