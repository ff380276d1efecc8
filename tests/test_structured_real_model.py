"""json_schema output of the real default model (SmolLM2-135M-Instruct) validates against
its schema: nested objects, enums, arrays with bounds, numbers with ranges."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams, StructuredOutputsParams

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
            "windy": {"type": "boolean"},
        },
        "required": ["condition", "temperature_c", "windy"],
        "additionalProperties": False,
    },
    "shopping": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"item": {"type": "string", "maxLength": 15},
                                   "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["item", "quantity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "scores": {
        "type": "array",
        "minItems": 3,
        "maxItems": 3,
        "items": {"type": "number", "minimum": 0, "maximum": 1},
    },
}
QUESTIONS = {
    "person": "Describe a fictional person as JSON with name, age and address.",
    "weather": "Give today's weather in Paris as JSON.",
    "shopping": "Write a short shopping list as JSON.",
    # without an example this small model writes 1.000... until max_tokens: the grammar
    # allows any number of fraction digits
    "scores": "Give three probabilities between 0 and 1 as a JSON array, like [0.25, 0.5, 0.75].",
}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


@pytest.mark.slow
def test_json_schema_outputs_validate(llm):
    """Each schema greedy and sampled, in one batch."""
    cases = [(name, t) for name in sorted(SCHEMAS) for t in (0.0, 0.8)]
    conversations = [[{"role": "user", "content": QUESTIONS[name]}] for name, _ in cases]
    params = [
        SamplingParams(temperature=t, seed=1, max_tokens=200,
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
        for name, t in cases
    ]
    outs = llm.chat(conversations, params, use_tqdm=False)
    for (name, t), out in zip(cases, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, t, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
