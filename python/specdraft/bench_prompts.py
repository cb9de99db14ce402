"""The built-in prompt set of ``specdraft bench``.

Most prompts are input-grounded (summarise, extract from, or edit a passage or a piece of
code given in the prompt), where a reply reuses the prompt's words and draft proposers such
as n-gram lookup have something to find; a few are open questions, where they have little.
Each entry is a list of chat messages; the bench applies the model's chat template.
"""

from __future__ import annotations

__all__ = ["PROMPTS", "WARMUP", "BenchPrompt", "bench_prompts"]

from dataclasses import dataclass

_PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps and flows north through Germany "
    "before reaching the North Sea in the Netherlands. It is about 1,230 kilometres long. "
    "For centuries it has been one of the most important trade routes in Europe, and cities "
    "such as Basel, Strasbourg, Cologne and Rotterdam grew along its banks. Barges carry "
    "coal, grain and containers on it today, and its valley between Bingen and Koblenz, "
    "with its castles and vineyards, is a UNESCO World Heritage Site."
)

_CODE = """def moving_average(values, window):
    result = []
    for i in range(len(values)):
        if i + 1 < window:
            continue
        total = 0
        for j in range(i + 1 - window, i + 1):
            total = total + values[j]
        result.append(total / window)
    return result
"""

_EMAIL = (
    "Hi team, the quarterly review moves from Tuesday 14 May to Thursday 16 May at 10:00 in "
    "room 4B. Maria Lopez will present the sales figures, Tom Becker the hiring plan, and "
    "Aiko Tanaka the product roadmap. Please send your slides to Maria by Wednesday noon. "
    "Lunch is provided. Regards, Daniel"
)

_RECIPE = (
    "Pancakes: whisk 200 g flour, 2 eggs, 300 ml milk and a pinch of salt into a smooth "
    "batter and let it rest for 20 minutes. Heat a little butter in a pan over medium heat, "
    "pour in a ladle of batter, tilt the pan to spread it, cook for one minute, flip, and "
    "cook for another 30 seconds. Serve with lemon and sugar."
)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: a name, its kind and its chat messages."""

    name: str
    kind: str  # "grounded" or "open"
    messages: tuple[dict[str, str], ...]


def _user(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text},)


#: The prompts, grounded ones first.
PROMPTS: list[BenchPrompt] = [
    BenchPrompt(
        "summarise-passage",
        "grounded",
        _user(f"Summarise this passage in three sentences:\n\n{_PASSAGE}"),
    ),
    BenchPrompt(
        "edit-code",
        "grounded",
        _user(
            "Rewrite this Python function so that it uses a running sum instead of the inner "
            f"loop. Keep the name and the behaviour.\n\n```python\n{_CODE}```"
        ),
    ),
    BenchPrompt(
        "extract-email",
        "grounded",
        _user(f"List every person named in this email with their task, one per line:\n\n{_EMAIL}"),
    ),
    BenchPrompt(
        "rewrite-recipe",
        "grounded",
        _user(f"Rewrite this recipe as a numbered list of steps:\n\n{_RECIPE}"),
    ),
    BenchPrompt(
        "docstring-code",
        "grounded",
        _user(
            "Add a docstring and type hints to this function and show the whole function:"
            f"\n\n```python\n{_CODE}```"
        ),
    ),
    BenchPrompt(
        "quote-passage",
        "grounded",
        _user(
            "Copy the sentence of this passage that mentions UNESCO, then explain it:"
            f"\n\n{_PASSAGE}"
        ),
    ),
    BenchPrompt(
        "edit-email",
        "grounded",
        _user(
            "Rewrite this email so that the meeting is on Friday 17 May instead; "
            f"change nothing else:\n\n{_EMAIL}"
        ),
    ),
    BenchPrompt(
        "extract-recipe",
        "grounded",
        _user(f"Which ingredients does this recipe use, with their amounts?\n\n{_RECIPE}"),
    ),
    BenchPrompt(
        "open-gravity", "open", _user("Why do objects fall to the ground? Explain simply.")
    ),
    BenchPrompt("open-story", "open", _user("Write a short story about a lighthouse keeper.")),
    BenchPrompt("open-advice", "open", _user("What are good habits for learning a new language?")),
    BenchPrompt(
        "open-compare", "open", _user("Compare trains and planes for travelling in Europe.")
    ),
]


#: The chat of the call that warms each engine before it is measured: none of
#: :data:`PROMPTS`, and about none of their subjects, so a proposer that learns from earlier
#: replies meets no measured prompt's reply in it.
WARMUP: tuple[dict[str, str], ...] = _user("Say hello.")


def bench_prompts(n: int | None = None) -> list[BenchPrompt]:
    """The first ``n`` prompts (all when ``n`` is None).

    ``n`` must be between 1 and the number of prompts.
    """
    if n is None:
        return list(PROMPTS)
    if not 1 <= n <= len(PROMPTS):
        raise ValueError(f"--prompts {n}: choose between 1 and {len(PROMPTS)}")
    return PROMPTS[:n]
