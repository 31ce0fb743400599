"""``kvnotes_reuse_miss_total{reason}`` for a plain prompt the decode engine computed itself (a plan
with no prefix steps: vLLM, cold or after its own prefix cache): the prefix tokens nobody reused are
counted, ``edit_declined`` where a found edit of a held prompt was declined, else ``unmatched``."""
from types import SimpleNamespace

from cluster.control.metrics import Metrics
from cluster.control.prompt_match import PromptMatcher
from kvruntime.messages.plan import Policy, RequestPlan
from tests.conftest import metric


def _count(held_edit, n: int, cached: int) -> str:
    matcher = SimpleNamespace(metrics=Metrics())
    fin = SimpleNamespace(plan=RequestPlan("r", "m", Policy.BALANCED, (), (7,)), cached_tokens=cached)
    PromptMatcher._count_misses(matcher, fin, SimpleNamespace(chunks=(), held_edit=held_edit), n)
    return matcher.metrics.render().decode()


def test_a_prompt_vllm_computed_alone_counts_the_tokens_its_cache_did_not_hold_as_unmatched():
    text = _count(None, 600, 256)
    assert metric(text, "kvnotes_reuse_miss_total", reason="unmatched") == 344
    assert metric(text, "kvnotes_reuse_miss_total", reason="edit_declined") == 0


def test_a_declined_edit_planned_cold_counts_them_as_edit_declined():
    text = _count(object(), 600, 128)
    assert metric(text, "kvnotes_reuse_miss_total", reason="edit_declined") == 472
    assert metric(text, "kvnotes_reuse_miss_total", reason="unmatched") == 0


def test_a_prompt_vllm_served_whole_from_its_cache_counts_no_miss():
    text = _count(None, 600, 600)
    assert metric(text, "kvnotes_reuse_miss_total", reason="unmatched") == 0
