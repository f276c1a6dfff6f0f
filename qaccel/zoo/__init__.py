"""Model zoo: offline data and (later) recipes and model cards."""

from .synthetic import bigram_sequences

__all__ = ["bigram_sequences"]
