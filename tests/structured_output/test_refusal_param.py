"""The engine's refusal of a constraint (its grammar does not compile against the tokenizer,
or its masks cost too much) names the request field the constraint came from
(StructuredOutputsParams.param, `structured_outputs` unless the caller says otherwise): the
OpenAI front sets `response_format` or `tools` and needs no renaming of its own. Offline
(LLM, LLMEngine over the fake runner) and through AsyncLLM with the core in a child process,
where the constraint crosses the pipe inside the request."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.llm import LLM
from slotserve.errors import RequestValidationError
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.test_engine_fake import assert_idle, prompts_for
from tests.helpers import FakeEngineFactory
from tests.structured_output.test_mask_budget import AMBIGUOUS, run

# Valid Lark, but it names a special token no tokenizer here has: only the core's compile
# against the tokenizer finds that, so the refusal comes from the engine, not the front.
UNCOMPILABLE = 'start: "a" <|no_such_token|>'


def uncompilable(**param: str) -> SamplingParams:
    return SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        grammar=UNCOMPILABLE, **param))


def test_the_field_is_no_part_of_the_constraint() -> None:
    named = StructuredOutputsParams(json_object=True, param="response_format")
    assert named == StructuredOutputsParams(json_object=True)
    assert pickle.loads(pickle.dumps(named)).param == "response_format"
    with pytest.raises(RequestValidationError) as info:
        StructuredOutputsParams(json_object=True, param="")
    assert info.value.param == "structured_outputs.param"


@pytest.mark.parametrize(("param", "named"), [({}, "structured_outputs"),
                                              ({"param": "response_format"}, "response_format")])
def test_a_grammar_that_does_not_compile_names_its_field(
        fake_engine: FakeEngineFactory, param: dict[str, str], named: str) -> None:
    llm = LLM(llm_engine=fake_engine())
    with pytest.raises(RequestValidationError, match="no_such_token") as info:
        llm.generate(prompts_for(2), [SamplingParams(max_tokens=4), uncompilable(**param)],
                     use_tqdm=False)
    assert info.value.param == named
    assert_idle(llm.llm_engine)


def test_a_grammar_refused_for_its_masks_names_its_field(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    manager = engine.engine_core.engine_core.structured_output_manager  # type: ignore[attr-defined]
    manager.mask_budget_s = 1e-9  # every client's rows are over it
    params = SamplingParams(max_tokens=12, ignore_eos=True, structured_outputs=AMBIGUOUS)
    tools = params.clone(structured_outputs=StructuredOutputsParams(
        grammar=AMBIGUOUS.grammar, param="tools"))
    done = run(engine, {"plain": (params, "user:a"), "tools": (tools, "user:b")})
    for rid, named in (("plain", "structured_outputs"), ("tools", "tools")):
        (c,) = done[rid][-1].outputs
        assert c.rejected and c.error_code == "grammar_too_expensive", c
        assert c.error_param == named, c
    assert_idle(engine)


def test_the_field_crosses_to_a_core_in_a_child_process() -> None:
    llm = AsyncLLM.from_engine_args(engine_mode="process", threads=1, num_blocks=64,
                                    max_num_seqs=4, max_model_len=256, check=True)

    async def refusal(params: SamplingParams, request_id: str) -> RequestValidationError:
        with pytest.raises(RequestValidationError) as info:
            async for _ in llm.generate("To be", params, request_id):
                pass
        return info.value

    async def both() -> tuple[RequestValidationError, RequestValidationError]:
        return (await refusal(uncompilable(param="tools"), "r0"),
                await refusal(uncompilable(), "r1"))

    try:
        tools, default = asyncio.run(both())
    finally:
        llm.shutdown()
    assert "no_such_token" in tools.message
    assert (tools.param, default.param) == ("tools", "structured_outputs")
