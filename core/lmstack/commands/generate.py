"""`lmstack generate`: stream a chat answer from the stack's model to the terminal."""

from __future__ import annotations

import argparse
import sys

from lmstack.sampling_params import SamplingParams


def run(args: argparse.Namespace) -> int:
    from lmstack.commands.stack_args import stack_from_args
    from lmstack.engine.llm_engine import LLMEngine

    engine = LLMEngine(stack_from_args(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    messages = [{"role": "user", "content": args.prompt}]
    req = engine.make_request(engine.input_processor.render_chat(messages), params)
    engine.enqueue(req)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    engine.shutdown()
    return 0
