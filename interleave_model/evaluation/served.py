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

The API key is read from the environment only (`OPENAI_API_KEY`, as lm-eval's local APIs read it) and never passed as
an argument, so it appears in no results file and no log. A server that refuses the connection, does not answer in
`--timeout` seconds, refuses the key or does not serve the model is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from interleave_model.evaluation.lm_eval_tasks import FOLDER

KEY_VARIABLE = "OPENAI_API_KEY"


class ServerError(RuntimeError):
    """A server that cannot be measured, in one line."""


def probe(base_url: str, model: str, timeout: float) -> None:
    """Ask the server for its models: it must answer within `timeout` seconds, accept the key and serve `model`.

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
        served = [entry["id"] for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{url}: not an OpenAI-compatible list of models") from None
    if model not in served:
        raise ServerError(f"{url}: the server serves {', '.join(served) or 'no model'}, not {model!r} (--model)")


def model_args(args: argparse.Namespace) -> tuple[str, dict, bool]:
    """lm-eval's model name, its arguments (never the key) and whether lm-eval applies the chat template."""
    base = args.base_url.rstrip("/")
    common = {"model": args.model, "num_concurrent": args.num_concurrent, "max_retries": args.max_retries,
              "timeout": int(args.timeout)}  # fmt: skip
    if args.api == "chat":
        return "local-chat-completions", common | {"base_url": f"{base}/chat/completions"}, True
    from transformers import AutoTokenizer

    from interleave_data.prompts import adds_special_tokens

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    chat = bool(getattr(tokenizer, "chat_template", None))
    completions = {"base_url": f"{base}/completions", "tokenizer_backend": "huggingface", "tokenizer": args.tokenizer,
                   "tokenized_requests": True, "add_bos_token": adds_special_tokens(tokenizer)}  # fmt: skip
    return "local-completions", common | completions, chat


def evaluate(args: argparse.Namespace) -> dict:
    """Probe the server, then run the tasks through lm-eval and save what it measured under `--output_path`."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    probe(args.base_url, args.model, args.timeout)
    name, arguments, chat = model_args(args)
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = lm_eval.simple_evaluate(
        model=name, model_args=arguments, tasks=args.tasks, limit=args.limit, log_samples=bool(args.output_path),
        apply_chat_template=chat, task_manager=TaskManager(include_path=str(FOLDER), metadata=args.metadata),
        evaluation_tracker=tracker,
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
    parser.add_argument("--tokenizer", help="the model's tokenizer (a folder or hub name); needed by --api completions")
    parser.add_argument("--tasks", nargs="+", default=["interleave"], help="interleave or interleave_<N>w tasks")
    parser.add_argument("--metadata", type=json.loads, default={},
                        help="the documents: JSON of corpus, seed, test_pairs, split_fractions, template")  # fmt: skip
    parser.add_argument("--limit", type=int, help="evaluate the first LIMIT pairs of each task only")
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
