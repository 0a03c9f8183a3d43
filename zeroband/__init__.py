"""zeroband: pretrain LLMs across data centres joined by slow, unreliable links."""

__version__ = "0.1.0"
