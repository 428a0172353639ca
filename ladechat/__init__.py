"""ladechat: a terminal chatbot that answers faster with lookahead decoding."""

__version__ = "0.1.0"
