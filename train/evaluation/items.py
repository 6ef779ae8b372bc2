"""What every task is made of: items, each a few (context, continuation) requests and the gold one.

The three task families of GPT-3's evaluation (Brown et al. 2020, section 2.4) are one shape:

  last word       one request: the passage without its last word, then " " + that word
  multiple choice one context shared by all endings: (context, " " + ending_i) for each ending i
  Winograd        one continuation shared by all contexts (partial scoring): the sentence up to
                  the blank with option i filled in, then the rest of the sentence

A k-shot item is the same item with k solved examples (their gold request, context + continuation)
and the few-shot delimiter in front of every context.
"""

from __future__ import annotations

from dataclasses import dataclass

LAST_WORD, CHOICE, PARTIAL = "last_word", "choice", "partial"  # the families; metrics.py scores each
TARGET_DELIMITER = " "  # between a context and its continuation, as lm-eval's tasks and GPT-3 put it
FEWSHOT_DELIMITER = "\n\n"  # between solved examples, and before the item


@dataclass(frozen=True)
class Item:
    """One example: the (context, continuation) request of each choice, and the index of the gold one."""

    requests: tuple[tuple[str, str], ...]
    gold: int = 0

    @property
    def solved(self) -> str:
        """The example as a demonstration: its gold context followed by its gold continuation."""
        context, continuation = self.requests[self.gold]
        return context + continuation

    def after(self, prefix: str) -> "Item":
        """The same item with `prefix` (solved examples and their delimiters) before every context."""
        return Item(tuple((prefix + context, continuation) for context, continuation in self.requests), self.gold)


def ending_length(continuation: str) -> int:
    """The characters acc_norm divides a choice's log-likelihood by: the ending without its leading
    target delimiter (lm-eval's `len(choice)`)."""
    return len(continuation.removeprefix(TARGET_DELIMITER))
