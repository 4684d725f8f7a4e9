"""How the ranks take a save or load together: each posts the outcome of its part (`attempt`), one rule
decides over all of them, and a failure anywhere is the same error on every rank (`raise_failed`)."""
from __future__ import annotations

from typing import Any, Callable, NoReturn

from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.checkpoint.view import CheckpointRole


def attempt(action: Callable[[], Any], rank: int) -> tuple[dict, Exception | None]:
    """What this rank posts of ``action`` (its result, or its error as text) and the error itself."""
    try:
        return {"result": action(), "error": None}, None
    except Exception as error:  # noqa: BLE001  (every rank learns of it and raises the same error)
        return {"result": None, "error": f"{type(error).__name__}: {error}", "rank": rank}, error


def failures_of(outcomes: list[dict | None]) -> list[tuple[int, str]]:
    return [(o["rank"], o["error"]) for o in outcomes if o is not None and o["error"] is not None]


def raise_failed(what: str, failures: list[tuple[int, str]], own: Exception | None, role: CheckpointRole,
                 consequence: str) -> NoReturn:
    """Raise the error every rank raises for a failed save or load; in one process the error itself."""
    if role.engine == "local" and own is not None:
        raise own
    where = "\n".join(f"  rank {r}: {error}" for r, error in failures)
    raise CheckpointError(f"{what} failed on {len(failures)} rank{'s' if len(failures) > 1 else ''}:\n{where}\n"
                          f"{consequence}") from own
