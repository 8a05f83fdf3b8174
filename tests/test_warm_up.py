"""The gateway's warm-up (gateway/warm_up.py): before it serves, one short generation per book (greedy, sampled) goes
through the draft model, so the books hold the draft model's measured cost and no request is the first to pay for
measuring it; a draft service that is down only leaves the books without it."""

from __future__ import annotations

from gateway.learned_priors import GATEWAY, PriorKey
from gateway.server import build_gateway_parts
from gateway.suffix_choice import MODEL
from specmesh.config import GatewayConfig
from tests.stack import start_draft, start_verifier
from tests.test_e2e_greedy import wait_blocks_free


def measured(gateway, sampled: bool) -> set[str]:
    """The proposers whose round cost the gateway-wide book holds."""
    book = gateway.servicer.priors._choices.get(PriorKey(GATEWAY, sampled))
    return {name for name, *_ in book.costs} if book is not None else set()


async def test_the_books_hold_the_draft_models_cost_before_the_first_request() -> None:
    verifier = await start_verifier(dtype="int8", decode_ahead_tokens=8)
    draft = await start_draft("tiny-draft", dtype="int8")
    try:
        assert draft.engine.num_steps == 0
        config = GatewayConfig(port=0, verifier_addr=verifier.addr, draft_addr=draft.addr, warm_up_tokens=16)
        gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
        try:
            assert draft.engine.num_steps > 0                         # the draft model ran: a prefill, model rounds
            assert MODEL in measured(gateway, sampled=False) and MODEL in measured(gateway, sampled=True)
            assert gateway.servicer.priors._num_alone == 2            # (exploration counts on from the warm-ups)
            await wait_blocks_free(verifier)                          # its sessions ended
        finally:
            await gateway.server.stop(0)
    finally:
        await draft.stop()
        await verifier.stop()


async def test_a_draft_service_that_is_down_leaves_the_books_without_it() -> None:
    verifier = await start_verifier(dtype="int8")
    try:
        config = GatewayConfig(port=0, verifier_addr=verifier.addr, draft_addr="127.0.0.1:1", warm_up_tokens=16,
                               draft_timeout_s=2.0)
        gateway = await build_gateway_parts(config, wait_for_verifier_s=30)
        try:
            assert MODEL not in measured(gateway, sampled=False)
            await wait_blocks_free(verifier)
        finally:
            await gateway.server.stop(0)
    finally:
        await verifier.stop()
