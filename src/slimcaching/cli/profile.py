"""Activation profiles: record (``profile``), count a trace, describe and fit them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from slimcaching.catalogue import INDEPENDENT_TOKENS
from slimcaching.catalogue import ROUTING_FORMATS as FORMATS
from slimcaching.cli.common import console, flags, out, show_progress, table
from slimcaching.errors import ScenarioError, printable

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command()
def profile(
    model: Annotated[str, typer.Argument(help="Hugging Face model directory or hub id.")],
    prompts: Annotated[Path, typer.Option("--prompts", help="Text lines, or JSONL with a text field "
                                          "(and 'image' paths for Qwen3-VL-MoE).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile file (.json or .npz).")],
    trace: Annotated[Path | None, typer.Option("--trace", help="Routing trace file (.npz); default: "
                                               "next to the profile.")] = None,
    generate: Annotated[int, typer.Option("--generate", min=0, help="Also route N decoded tokens per prompt "
                                          "(encoder-decoder: N decoder tokens, at least 1).")] = 0,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda[:i].")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16, float16.")] = "auto",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Prompts per forward pass.")] = 8,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Prefill token budget (whole "
                                                   "prompts; a first prompt longer than it is truncated).")] = None,
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL field with the text.")] = "text",
    phases: Annotated[str, typer.Option("--phases", help="Tokens in the profile: all, prefill or decode.")] = "all",
    name: Annotated[str | None, typer.Option("--name", help="Model name in the profile (default: the "
                                             "directory name).")] = None,
) -> None:
    """Record which experts a Hugging Face MoE model's routers choose, per token and layer."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from rich.progress import Progress

    from slimcaching.inputs.hf import profile_model, read_prompts  # start-up
    if output.suffix not in (".json", ".npz"):
        raise ScenarioError("--output", "profile files end in .json or .npz", str(output))
    sel = {"all": (0, 1), "prefill": (0,), "decode": (1,)}.get(phases)
    if sel is None:
        raise ScenarioError("--phases", "expected all, prefill or decode", phases)
    if phases == "decode" and generate == 0:
        raise ScenarioError("--phases", "decode tokens need --generate N", phases)
    with flags(prompts="--prompts"):
        items = read_prompts(prompts, text_field)
    with Progress(console=console, transient=True, disable=not show_progress()) as progress:
        task = progress.add_task("profiling", total=len(items))

        def report(done, total, tokens):
            progress.update(task, completed=done, description=f"profiling ({tokens} prefill tokens)")

        with flags(prompts="--prompts", dtype="--dtype", device="--device"):
            tr = profile_model(model, items, device=device, dtype=dtype, batch_size=batch_size,
                               max_tokens=max_tokens, generate=generate, progress=report)
    model_name = name or Path(model.rstrip("/")).name
    prof = tr.to_profile(model_name, sel)
    prof.meta.update({k: v for k, v in tr.meta.items()})
    prof.meta["phases"] = phases
    trace_path = trace or output.with_name(output.stem + ".trace.npz")
    tr.save(trace_path)
    prof.save(output)
    console.print(f"{tr.meta['family']}: {len(tr.layer_names)} MoE layers, E={tr.num_experts}, K={tr.top_k}, "
                  f"{tr.meta['prefill_tokens']} prefill tokens; wrote {output} and {trace_path}")


@app.command("profile-from-trace")
def profile_from_trace_cmd(
    trace_file: Annotated[Path, typer.Argument(help="Routing trace: .npy (tokens x layers x K expert ids) or a "
                                               "slimcaching .trace.npz.")],
    model: Annotated[str, typer.Option("--model", help="Model name for the profile.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile file (.json or .npz).")],
) -> None:
    """Count a raw routing trace into a co-activation profile."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.evaluation.simulate import load_trace_array  # start-up
    from slimcaching.inputs.fileio import check_target
    from slimcaching.inputs.hf import RoutingTrace
    from slimcaching.inputs.profiles import profile_from_trace  # start-up
    if output.suffix not in (".json", ".npz"):
        raise ScenarioError("--output", "profile files end in .json or .npz", str(output))
    printable(model, "--model")
    check_target(output, "--output")
    if trace_file.suffix == ".npy":
        prof = profile_from_trace(load_trace_array(trace_file), model, {"source": trace_file.name})
    elif trace_file.suffix == ".npz":
        prof = RoutingTrace.load(trace_file).to_profile(model)
    else:
        raise ScenarioError("trace", "expected a .npy or .npz file", str(trace_file))
    prof.check("trace")  # a trace whose rows repeat an expert or hold negative ids is no routing
    prof.save(output)
    console.print(f"wrote {output}: {len(prof.layers)} layers, K={prof.layers[0].sets.shape[1]}")


@app.command("profile-import")
def profile_import_cmd(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help=f"One of {', '.join(FORMATS)}.")],
    files: Annotated[list[Path], typer.Argument(metavar="FILE...", help="The engine's record files (several "
                                                "ranks' dumps or JSONL files add up).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile file (.json or .npz).")],
    model: Annotated[str | None, typer.Option("--model", help="Model name in the profile (default: the first "
                                              "file's stem).")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Routing trace (.trace.npz) of per-token records; "
                                               "default: next to the profile.")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=1, help="Experts per token (counts-only formats and "
                                              "sglang-routed).")] = None,
    experts: Annotated[int | None, typer.Option("--experts", min=1, help="Experts per layer of the model "
                                                "(default: the highest id seen + 1).")] = None,
    layers: Annotated[int | None, typer.Option("--layers", min=1, help="sglang-routed: layers per token in the "
                                               "record (default: from meta_info's token counts).")] = None,
    physical_map: Annotated[Path | None, typer.Option("--physical-map", help="counts: .npy (layers, physical "
                                                      "experts) of logical ids, to fold replicas back.")] = None,
    phases: Annotated[str, typer.Option("--phases", help="Tokens in the profile: all, prefill or decode.")] = "all",
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Counts-only: tokens drawn per layer under the "
                                        "independence assumption.")] = INDEPENDENT_TOKENS,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Counts-only: seed of those draws.")] = 0,
) -> None:
    """Import routing recorded by SGLang or vLLM (or plain counts / token files) as a profile."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.inputs.fileio import check_target
    from slimcaching.inputs.routing_import import read_routing, to_profile
    if output.suffix not in (".json", ".npz"):
        raise ScenarioError("--output", "profile files end in .json or .npz", str(output))
    sel = {"all": (0, 1), "prefill": (0,), "decode": (1,)}.get(phases)
    if sel is None:
        raise ScenarioError("--phases", "expected all, prefill or decode", phases)
    name = printable(model if model is not None else files[0].stem.split(".")[0], "--model")
    check_target(output, "--output")
    imp = read_routing(fmt, files, top_k=top_k, experts=experts, layers=layers, physical_map=physical_map)
    if not imp.per_token and (trace is not None or phases != "all"):
        raise ScenarioError("--trace" if trace is not None else "--phases",
                            f"{fmt} holds counts, not tokens: no trace and no phases")
    if imp.per_token:
        trace_path = trace or output.with_name(output.stem + ".trace.npz")
        check_target(trace_path, "--trace")
    prof = to_profile(imp, name, sel, tokens=tokens, seed=seed)
    prof.meta["phases"] = phases
    prof.check("profile")
    wrote = [str(output)]
    if imp.per_token:
        imp.trace().save(trace_path)
        wrote.append(str(trace_path))
    prof.save(output)
    how = ("co-activation measured" if imp.per_token else
           f"counts only: sets drawn assuming independent experts ({tokens} tokens per layer)")
    console.print(f"{fmt}: {len(prof.layers)} MoE layers, E={imp.num_experts}, K={imp.top_k}; {how}; "
                  f"wrote {' and '.join(wrote)}")


@app.command("profile-stats")
def profile_stats_cmd(
    profile_file: Annotated[Path, typer.Argument(help="Profile (.json/.npz).")],
    other: Annotated[Path | None, typer.Option("--compare", help="A second profile to compare with.")] = None,
    heatmap: Annotated[Path | None, typer.Option("--heatmap", help="Write a per-layer heat map (PNG).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Skew, co-activation and differences of activation profiles."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.evaluation.profile_stats import compare, layer_stats, provenance, summary_stats
    from slimcaching.evaluation.profile_stats import heatmap as draw
    from slimcaching.inputs.profiles import Profile  # start-up
    prof = Profile.load(profile_file, "profile")
    result = {"summary": summary_stats(prof), "provenance": provenance(prof), "layers": layer_stats(prof)}
    if other is not None:
        result["compare"] = compare(prof, Profile.load(other, "--compare"))
    if heatmap is not None:
        draw(prof, str(heatmap))
    if as_json:
        sys.stdout.write(json.dumps(result, allow_nan=False) + "\n")
        return
    s = result["summary"]
    out.print(f"{prof.model}: {s['layers']} layers; normalised entropy {s['entropy_norm']:.3f}, top-10% experts "
              f"carry {s['top10pct_share']:.1%}, most frequent set {s['top_set_prob']:.1%}, "
              f"{s['distinct_sets']:.0f} distinct sets per layer")
    pv = result["provenance"]
    out.print(f"co-activation: {pv['coactivation']}; measured: {'; '.join(pv['measured']) or 'nothing'}; "
              f"assumed: {'; '.join(pv['assumed']) or 'nothing'}")
    t = table("layer", "sets", "entropy", "top-10%", "top pair (lift)")
    for st in result["layers"]:
        pair = st["top_pairs"][0] if st["top_pairs"] else None
        t.add_row(str(st["layer"]), str(st["distinct_sets"]), f"{st['entropy_norm']:.3f}",
                  f"{st['top10pct_share']:.1%}",
                  f"{pair['pair']} p={pair['prob']:.3f} lift={pair['lift']:.2f}" if pair else "-")
    out.print(t)
    if "compare" in result:
        tv = [c["tv_sets"] for c in result["compare"]]
        out.print(f"difference: total variation of set distributions mean {sum(tv) / len(tv):.3f}, "
                  f"max {max(tv):.3f}")
    if heatmap is not None:
        console.print(f"wrote {heatmap}")


@app.command("profile-fit")
def profile_fit_cmd(
    profile_file: Annotated[Path, typer.Argument(help="Measured profile (.json/.npz).")],
    tokens: Annotated[int, typer.Option(help="Tokens per synthetic profile.")] = 2000,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the fitted synthetic router.")] = 0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the fit as JSON.")] = None,
) -> None:
    """Fit the synthetic router's parameters to a measured profile (to scale it to many users)."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.evaluation.profile_stats import fit_synthetic
    from slimcaching.inputs.fileio import atomic_write
    from slimcaching.inputs.profiles import Profile  # start-up
    fit = fit_synthetic(Profile.load(profile_file, "profile"), tokens=tokens, seed=seed)
    text = json.dumps(fit, indent=1, allow_nan=False) + "\n"
    if output:
        atomic_write(output, text)
        console.print(f"wrote {output}")
    else:
        sys.stdout.write(text)
