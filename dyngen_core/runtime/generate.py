"""`run_generate`: the blocking ``generator.generate(...)`` convenience over enqueue/iterate."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dyngen_core.engine.job import Job
from dyngen_core.engine.results import Result
from dyngen_core.errors import JobError

if TYPE_CHECKING:
    from dyngen_core.runtime.generator import DynamicGenerator


def run_generate(
    generator: DynamicGenerator,
    prompt: str | Sequence[str],
    max_new_tokens: int,
    *,
    min_new_tokens: int = 0,
    stop_conditions: Sequence[int | str] | None = None,
    gen_settings: Any = None,
    add_bos: bool = False,
    encode_special_tokens: bool = False,
    decode_special_tokens: bool = False,
    completion_only: bool = True,
    seed: int | None = None,
    return_last_results: bool = False,
    abort_event: threading.Event | None = None,
    banned_strings: Sequence[str] | None = None,
    constraint: Any = None,
    progress: bool = False,
) -> Any:
    """Run prompts to completion and return their text.

    Args:
        prompt: one string (a string comes back) or a list (a list comes back, same order).
        max_new_tokens: most tokens generated per prompt.
        min_new_tokens: stop conditions are ignored until this many tokens were generated.
        stop_conditions: token ids and strings that end a completion; None means the model's
            end-of-sequence ids, [] means none (only max_new_tokens ends it).
        gen_settings: one `SamplerSettings` for all prompts, or a list with one per prompt;
            None uses the model's generation_config.json defaults.
        add_bos: prepend the BOS token to each prompt.
        encode_special_tokens: parse special-token strings in the prompt as special tokens.
        decode_special_tokens: show special tokens in the output text.
        completion_only: return only the completion; False returns prompt + completion.
        seed: job i gets seed + i, so each completion is reproducible.
        return_last_results: also return each prompt's final `Result` (a tuple comes back).
        abort_event: a threading.Event; when set, the queue is cleared and None is returned.
            However the call ends (an exception, Ctrl-C), it leaves no job of its own queued.
        banned_strings: strings that must never appear (case-insensitive).
        constraint: a constraint for every prompt (JSON schema, regex, grammar or choices).
        progress: show a tqdm bar over finished prompts.

    The generator must have no other jobs queued: generate() drives the queue itself. Use
    `BackgroundGenerator` to mix generate-style calls with other work.
    """
    single = isinstance(prompt, str)
    prompts: list[str] = [prompt] if isinstance(prompt, str) else list(prompt)
    if not all(isinstance(p, str) for p in prompts):
        raise JobError("prompt must be a string or a list of strings; encode token ids into "
                       "a Job and use enqueue() for those")
    if abort_event is not None and not callable(getattr(abort_event, "is_set", None)):
        raise JobError(f"abort_event must be a threading.Event (anything with is_set()); got "
                       f"{type(abort_event).__name__}")
    settings = _per_prompt_settings(gen_settings, len(prompts))
    if generator.num_remaining_jobs():
        raise JobError(
            "generate() needs an idle generator, but jobs are queued; finish them with "
            "iterate(), call clear_queue(), or use BackgroundGenerator for concurrent work"
        )
    tokenizer = generator.tokenizer
    jobs = [
        Job(
            input_ids=tokenizer.encode(p, add_bos=add_bos,
                                       encode_special_tokens=encode_special_tokens),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            stop_conditions=stop_conditions,
            gen_settings=settings[i],
            identifier=i,
            seed=None if seed is None else seed + i,
            decode_special_tokens=decode_special_tokens,
            banned_strings=banned_strings,
            constraint=constraint,
        )
        for i, p in enumerate(prompts)
    ]
    generator.enqueue(jobs)
    try:
        finals = _drive(generator, len(jobs), abort_event, progress)
    except BaseException:
        generator.clear_queue()  # every queued job is this call's: leave the generator idle
        raise
    if finals is None:
        return None
    texts = [
        (prompts[i] if not completion_only else "") + finals[i]["full_completion"]
        for i in range(len(prompts))
    ]
    last = [finals[i] for i in range(len(prompts))]
    if single:
        return (texts[0], last[0]) if return_last_results else texts[0]
    return (texts, last) if return_last_results else texts


def _per_prompt_settings(gen_settings: Any, n: int) -> list[Any]:
    if isinstance(gen_settings, (list, tuple)):
        if len(gen_settings) != n:
            raise JobError(
                f"gen_settings has {len(gen_settings)} entries for {n} prompts; pass one "
                "settings object, or exactly one per prompt"
            )
        return list(gen_settings)
    return [gen_settings] * n


def _drive(generator: DynamicGenerator, n: int, abort_event: threading.Event | None,
           progress: bool) -> dict[int, Result] | None:
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc="generating", unit="job")
    finals: dict[int, Result] = {}
    try:
        while generator.num_remaining_jobs():
            if abort_event is not None and abort_event.is_set():
                generator.clear_queue()
                return None
            for result in generator.iterate():
                if result["eos"]:
                    finals[result["identifier"]] = result
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return finals
