"""Who gives up its blocks: the preemption victim policy (pure functions over the running list)."""

from __future__ import annotations

from conveyor.engine.core.request import Request


def pick_victim(running: list[Request]) -> Request:
    """The running request with the highest priority value, the latest admitted on ties.

    `running` is in admission order and not empty.
    """
    victim = running[-1]
    for request in reversed(running):
        if request.priority > victim.priority:
            victim = request
    return victim


def victims_below(running: list[Request], priority: int) -> list[Request]:
    """Running requests of strictly lower rank than `priority` (a higher value), worst first.

    Strictly: a request never displaces one of equal priority, so two requests can
    never take turns preempting each other (vLLM issue #40004).
    """
    ranked = [(r.priority, i, r) for i, r in enumerate(running) if r.priority > priority]
    ranked.sort(key=lambda entry: entry[:2], reverse=True)
    return [request for _, _, request in ranked]


def any_below(running: list[Request], priority: int) -> bool:
    return any(request.priority > priority for request in running)
