"""`python -m tests.integration.counting_worker worker ...`: the `plurai` command, its native
engine counting every token it generates into $PLURAI_TEST_TOKEN_LOG (a line per step,
appended with one write each, so a SIGKILLed worker's count is whole up to its last step).
The resume tests add these up across workers to compare tokens computed with tokens
delivered."""

from __future__ import annotations

import os

from plurai.cli.main import main
from plurai.gpu_workers.engine.engine import Engine

_step = Engine.step
_log = os.open(os.environ["PLURAI_TEST_TOKEN_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def counted_step(self: Engine):  # noqa: ANN201
    outs = _step(self)
    made = sum(len(o.new_token_ids) for o in outs)
    if made:
        os.write(_log, b"%d\n" % made)
    return outs


Engine.step = counted_step  # type: ignore[method-assign]

raise SystemExit(main())
