"""The README's demo request, answered by the embedded default model: the skill `kvnotes run`
registers and the README's question, rendered by the cluster's own Renderer (frame, chunk,
question + turn close), greedy through the reference engine: the answer states the fact."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import direct_text


def test_the_default_model_answers_the_readme_demo_question():
    from cluster.control.render import Renderer
    from cluster.operator.demo import DEMO_FACT, DEMO_QUESTION, DEMO_SKILL, DEMO_SKILL_NAME
    from kvruntime.fidelity.metrics import answer_correct
    from kvruntime.config import ClusterConfig
    from tests.conftest import get_engine

    model = ClusterConfig().workers.model                   # what `kvnotes run` / `scripts/dev.sh run` serves
    e = get_engine(model)
    r = Renderer(e.tokenizer, e.spec, None, e.bos_id)
    ids = list(r.frame()) + list(r.chunk_ids(DEMO_SKILL)) + r.user_then_markup(DEMO_QUESTION, e.spec.chat_user_suffix)
    text = direct_text(ids, 48, model)              # the README's request: max_tokens 48, temperature 0
    assert answer_correct(text, DEMO_FACT), (model, DEMO_QUESTION, text)
    # and the README asks exactly this question of exactly this skill
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f'{{"skill": "{DEMO_SKILL_NAME}"}}, {{"text": "{DEMO_QUESTION}"}}' in readme
