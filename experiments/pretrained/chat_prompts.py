"""The factual chat prompts the int8 chat replies are judged on (`experiments.chat_replies`).

Data only, no JAX: the launcher builds its flags' defaults from them before JAX starts.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    answer: str  # a regular expression (case-insensitive) the reply should match


# Questions with one short, checkable answer. Float SmolLM2-135M does not answer all of them
# right (it names Neptune the largest planet): the table reads each mode against float's count.
PROMPTS = (
    Prompt("What is the capital of France?", r"\bParis\b"),
    Prompt("What is 2 + 2?", r"\b(4|four)\b"),
    Prompt("Who wrote Hamlet?", r"\bShakespeare\b"),
    Prompt("What colour is the sky on a clear day?", r"\bblue\b"),
    Prompt("Which planet is the largest in our solar system?", r"\bJupiter\b"),
    Prompt("Name a prime number between 20 and 30.", r"\b(23|29)\b"),
)
