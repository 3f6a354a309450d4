"""mtpipe: Qwen3.5/3.6 across a pipeline of Macs with native MTP speculative decoding."""

__version__ = "0.1.0"
