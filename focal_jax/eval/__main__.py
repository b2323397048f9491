"""`python -m focal_jax.eval <command> [args]`: the evaluation command lines in one place.

    python -m focal_jax.eval perplexity --workdir DIR [--topk all]     soft and hard top-k perplexity, pairs retained
    python -m focal_jax.eval diagnostics --workdir DIR                 group dominance, confidence, top tokens, entropy
    python -m focal_jax.eval recall --workdir DIR [--lengths ...]      long-context recall suite, accuracy per length
    python -m focal_jax.eval harness --workdir DIR --tasks T1,T2       lm-evaluation-harness tasks (HARNESS.md)
    python -m focal_jax.eval helmet --workdir DIR --data HELMET_DATA   HELMET (recall, RAG, re-rank, ICL, LongQA)
                                                                       per length (HARNESS.md)

Every command takes `--step S` to evaluate an intermediate checkpoint instead of the latest.

`python -m focal_jax.eval <command> --help` lists a command's arguments.
"""

import importlib
import sys

COMMANDS = {"perplexity": "focal_jax.eval.perplexity", "diagnostics": "focal_jax.eval.diagnostics",
            "recall": "focal_jax.eval.recall", "harness": "focal_jax.eval.harness", "helmet": "focal_jax.eval.helmet"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    importlib.import_module(COMMANDS[command]).main(rest)  # the commands' mains return their results
    return 0


if __name__ == "__main__":
    sys.exit(main())
