"""Measure a model behind an OpenAI-compatible server (vLLM's `vllm serve`, a hosted API) with the lm-eval tasks.

    vllm serve /models/Llama-3.2-3B-Instruct --served-model-name llama --port 8000 &
    python -m interleave_model.evaluation.served --base_url http://localhost:8000/v1 --model llama \
        --tasks interleave --output_path lm_eval_results

`--api chat` (the default) sends each prompt as one user message to `/chat/completions`: the server applies the
model's chat template, as `cli.py test` does. `--api completions` sends tokens to `/completions`, made here with
`--tokenizer` (the model's folder or hub name) as `cli.py test` makes them: chat-formatted when the tokenizer has a
template, with the tokenizer's special tokens when it has none. Either way lm-eval's local APIs
(`local-chat-completions`, `local-completions`) do the requests, greedy, within each length's held-out budget, and
write their results and samples under `--output_path`, which `python -m interleave_model.evaluation.report` reads.

`--max_length` is the most tokens one request may hold, prompt and answer: by default the server's own limit (vLLM
states its `max_model_len` with its models), else the tokenizer's `model_max_length`. lm-eval's completions API sends
at most `max_length - 1` tokens of prompt and answer budget and cuts what is over off the prompt's front (the chat
header and the instruction), so a task whose longest prompt and budget do not fit is refused before any request. Chat
requests go out whole and the server applies its own limit; `--tokenizer` lets them be checked the same way.
`--gen_kwargs` sets every task's generation settings in lm-eval's syntax, e.g. `max_gen_toks=64`.

The API key is read from the environment only (`OPENAI_API_KEY`, as lm-eval's local APIs read it) and never passed as
an argument, so it appears in no results file and no log. A server that refuses the connection, does not answer in
`--timeout` seconds, refuses the key or does not serve the model is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Sequence

from interleave_model.evaluation.lm_eval_tasks import FOLDER

KEY_VARIABLE = "OPENAI_API_KEY"


class ServerError(RuntimeError):
    """A server that cannot be measured, in one line."""


def probe(base_url: str, model: str, timeout: float) -> int | None:
    """Ask the server for its models: it must answer within `timeout` seconds, accept the key and serve `model`.

    Returns:
        The most tokens a request to `model` may hold, when the server says (vLLM's `max_model_len`), else None.

    Raises:
        ServerError: One line saying which of those failed.
    """
    import requests

    url = f"{base_url.rstrip('/')}/models"
    key = os.environ.get(KEY_VARIABLE)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = requests.get(url, headers=headers, timeout=timeout)
    except requests.ConnectionError:
        raise ServerError(f"{url}: connection refused: is the server running, at this address?") from None
    except requests.Timeout:
        raise ServerError(f"{url}: no answer within {timeout:g} s (raise --timeout for a slow server)") from None
    if response.status_code in (401, 403):
        state = "refused the key in" if key else "needs a key: set"
        raise ServerError(f"{url}: the server {state} {KEY_VARIABLE} (HTTP {response.status_code})")
    if response.status_code != 200:
        raise ServerError(f"{url}: HTTP {response.status_code} {response.reason}")
    try:
        served = {entry["id"]: entry for entry in response.json()["data"]}
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{url}: not an OpenAI-compatible list of models") from None
    if model not in served:
        raise ServerError(f"{url}: the server serves {', '.join(served) or 'no model'}, not {model!r} (--model)")
    limit = served[model].get("max_model_len")
    return limit if isinstance(limit, int) else None


def context_length(flag: int | None, served: int | None, tokenizer) -> tuple[int | None, str]:
    """The most tokens one request may hold, prompt and answer, and whose limit that is: `--max_length`, else the
    server's, else the tokenizer's `model_max_length` (not transformers' stand-in for a tokenizer that has none)."""
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    if flag is not None:
        return flag, "--max_length"
    if served is not None:
        return served, "the server's max_model_len"
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and limit < VERY_LARGE_INTEGER:
        return limit, "the tokenizer's model_max_length"
    return None, ""


def check_fit(tasks: dict, tokenizer, gen_kwargs: dict, limit: int | None, max_length: int, whose: str) -> None:
    """Refuse a task whose longest prompt and answer budget do not fit in `max_length` tokens.

    lm-eval's API models hold one token back and send `local-completions` the last `max_length - 1 - max_gen_toks`
    tokens of each prompt (`TemplateAPI.generate_until`; a budget past the limit makes that a negative slice, which
    drops the prompt's first tokens instead): a prompt that does not fit loses its chat header and instruction. The
    prompts are counted as lm-eval tokenizes them, in the tokenizer's chat template when it has one.

    Args:
        tasks: lm-eval's tasks by name, as `TaskManager.load` gives them.
        tokenizer: The model's tokenizer.
        gen_kwargs: `--gen_kwargs`, which override each task's `generation_kwargs`.
        limit: The pairs of each task that will be sent (the first `limit`), or None for all.
        max_length: The most tokens a request may hold.
        whose: Whose limit `max_length` is, for the message.

    Raises:
        ServerError: The first task that does not fit, in one line.
    """
    from interleave_data.prompts import adds_special_tokens

    chat = bool(getattr(tokenizer, "chat_template", None))
    for name, task in tasks.items():
        budget = int((task.config.generation_kwargs | gen_kwargs)["max_gen_toks"])
        prompts = [task.doc_to_text(doc) for doc in itertools.islice(task.eval_docs, limit)]
        if chat:
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True) for prompt in prompts]  # fmt: skip
        ids = tokenizer(prompts, add_special_tokens=adds_special_tokens(tokenizer)).input_ids
        longest = max(map(len, ids))
        if (need := longest + budget + 1) > max_length:
            raise ServerError(
                f"{name}: a prompt of {longest:,} tokens and an answer budget of {budget:,} (max_gen_toks) need "
                f"{need:,} with the one lm-eval keeps spare, more than {whose} ({max_length:,}): serve a longer "
                "context, or lower the budget with --gen_kwargs max_gen_toks=N"
            )


def model_args(args: argparse.Namespace, tokenizer, max_length: int | None) -> tuple[str, dict, bool]:
    """lm-eval's model name, its arguments (never the key) and whether lm-eval applies the chat template.

    `max_length` goes to `local-completions` only: lm-eval's chat requests are sent whole, and lm-eval's default of
    2048 would cut the completions' prompts.
    """
    base = args.base_url.rstrip("/")
    common = {"model": args.model, "num_concurrent": args.num_concurrent, "max_retries": args.max_retries,
              "timeout": int(args.timeout)}  # fmt: skip
    if args.api == "chat":
        return "local-chat-completions", common | {"base_url": f"{base}/chat/completions"}, True
    from interleave_data.prompts import adds_special_tokens

    chat = bool(getattr(tokenizer, "chat_template", None))
    completions = {"base_url": f"{base}/completions", "tokenizer_backend": "huggingface", "tokenizer": args.tokenizer,
                   "tokenized_requests": True, "add_bos_token": adds_special_tokens(tokenizer),
                   "max_length": max_length}  # fmt: skip
    return "local-completions", common | completions, chat


def evaluate(args: argparse.Namespace) -> dict:
    """Probe the server, then run the tasks through lm-eval and save what it measured under `--output_path`."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import simple_parse_args_string
    from transformers import AutoTokenizer

    server_limit = probe(args.base_url, args.model, args.timeout)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
    max_length, whose = context_length(args.max_length, server_limit, tokenizer)
    if args.api == "completions" and max_length is None:
        raise ServerError(f"{args.base_url}: neither the server nor the tokenizer states how many tokens a request "
                          "may hold: pass --max_length")  # fmt: skip
    gen_kwargs = simple_parse_args_string(args.gen_kwargs)
    manager = TaskManager(include_path=str(FOLDER), metadata=args.metadata)
    if tokenizer is not None and max_length is not None:
        check_fit(manager.load(args.tasks)["tasks"], tokenizer, gen_kwargs, args.limit, max_length, whose)
    name, arguments, chat = model_args(args, tokenizer, max_length)
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = lm_eval.simple_evaluate(
        model=name, model_args=arguments, tasks=args.tasks, limit=args.limit, log_samples=bool(args.output_path),
        apply_chat_template=chat, gen_kwargs=gen_kwargs or None, task_manager=manager, evaluation_tracker=tracker,
    )  # fmt: skip
    if tracker is not None:
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m interleave_model.evaluation.served", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--base_url", required=True, help="the server's OpenAI API root, e.g. http://localhost:8000/v1")
    parser.add_argument("--model", required=True, help="the model's name on the server (vLLM: --served-model-name)")
    parser.add_argument("--api", choices=("chat", "completions"), default="chat")
    parser.add_argument("--tokenizer",
                        help="the model's tokenizer (a folder or hub name); needed by --api completions, and with "
                        "--api chat it counts the prompts, so a task that cannot fit is refused")  # fmt: skip
    parser.add_argument("--tasks", nargs="+", default=["interleave"], help="interleave or interleave_<N>w tasks")
    parser.add_argument("--metadata", type=json.loads, default={},
                        help="the documents: JSON of corpus, seed, test_pairs, split_fractions, template")  # fmt: skip
    parser.add_argument("--limit", type=int, help="evaluate the first LIMIT pairs of each task only")
    parser.add_argument("--max_length", type=int,
                        help="the most tokens one request may hold, prompt and answer (default: the server's "
                        "max_model_len, else the tokenizer's model_max_length)")  # fmt: skip
    parser.add_argument("--gen_kwargs",
                        help="generation settings for every task in lm-eval's syntax, e.g. max_gen_toks=64 (the "
                        "answer budget; each task's default is 3 tokens an answer word + 8)")  # fmt: skip
    parser.add_argument("--output_path", help="folder for lm-eval's results and samples")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--max_retries", type=int, default=3)
    parser.add_argument("--num_concurrent", type=int, default=1, help="requests in flight at once")
    args = parser.parse_args(argv)
    if args.api == "completions" and not args.tokenizer:
        parser.error("--api completions needs --tokenizer (the model's folder or hub name)")
    try:
        results = evaluate(args)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # lm-eval's requests end in requests' or tenacity's errors, or aiohttp's
        if not _is_transport(err):
            raise
        print(f"error: {args.base_url}: the server failed a request: {_first_line(err)}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    return 0


def _is_transport(err: BaseException) -> bool:
    """An error of the connection or of the server's answers (as lm-eval raises them after its retries)."""
    names = {"requests", "urllib3", "aiohttp", "tenacity"}
    chain = [err, err.__cause__, err.__context__]
    return any(e is not None and type(e).__module__.split(".")[0] in names for e in chain)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
