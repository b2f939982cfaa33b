"""The rows of the support table (:mod:`dsv4_train.support`): every :class:`~dsv4_train.support_features.Relation`
of ``dsv4 train``'s features, each with its verdict, reason and the test that runs or refuses it."""

from __future__ import annotations

from dsv4_train.support_features import Relation

_GRAPH_ONE_RANK = (
    "--cuda-graph supports one model-parallel rank (got pp={pp}, ep={ep}, tp={tp}): pipeline transfers and the "
    "expert all-to-all have data-dependent sizes; drop --cuda-graph"
)
_MATRIX = "tests/test_parallel_matrix.py::test_cell_matches_single_process"
_CP = "tests/test_train_context_parallel.py::"
_EVAL = "tests/test_train_eval_parallel.py::test_parallel_evaluation_matches_single_process"
_TP = "tests/test_train_tensor_parallel.py::"
_TP4 = "tests/test_train_tp4.py::"
_TP4_CKPT = "tests/test_train_tp4_ckpt.py::"
_REFUSALS = "tests/test_support_table.py::test_every_refusal_raises_its_reason"
_TP_COMBOS = "tests/test_train_tensor_parallel_combos.py::test_tp2_combination_fp32_matches_one_process"
_TPCP = "tests/test_train_tensor_context_parallel.py::test_tp2xcp2_from_the_cli_equals_one_process"
_TPCPEP = "tests/test_train_tp_cp_ep.py::"
_TPCP8 = "tests/test_train_tp_cp_pp_dp.py::"

RELATIONS: tuple[Relation, ...] = (
    # refused: decided by the config
    Relation(
        ("vpp",),
        "refused",
        "--vpp {vpp} needs pipeline stages to interleave: set --pp >= 2 (got --pp {pp}) or drop --vpp",
        "tests/test_vpp_config.py::test_vpp_refusals_name_the_fix",
        without=("pp",),
    ),
    Relation(
        ("vpp", "cp"),
        "refused",
        "--vpp {vpp} with --cp {cp} is not supported yet: no parity test covers virtual pipeline stages with "
        "context parallelism (use --pp without --vpp, or --cp 1)",
        "tests/test_vpp_config.py::test_vpp_refusal_with_cp_and_evaluation_under_cp_or_vpp",
    ),
    Relation(
        ("cp", "cuda_graph"),
        "refused",
        "--cuda-graph with --cp {cp} is not supported: graph capture is validated on one GPU only and the CP "
        "attention exchanges document boundaries that change every step; drop --cuda-graph or use --cp 1",
        "tests/test_context_parallel.py::test_cp_config_checks",
    ),
    Relation(
        ("offload_overlap",),
        "refused",
        "--optimizer-offload-overlap only applies with --optimizer-cpu-offload; add that flag",
        "tests/test_offload_pipeline.py::test_cli_flag",
        without=("offload",),
    ),
    Relation(
        ("offload_defer",),
        "refused",
        "--optimizer-offload-defer defers the pipelined host step: it needs --optimizer-offload-overlap "
        "(and --optimizer-cpu-offload); add them",
        "tests/test_offload_defer.py::test_cli_flag",
        without=("offload_overlap",),
    ),
    Relation(
        ("offload", "offload_overlap", "offload_defer", "cuda_graph"),
        "refused",
        "--optimizer-offload-defer with --cuda-graph: not supported (the forward waits on the host thread's "
        "events module by module, host synchronisation a captured graph cannot hold); drop one of them",
        _REFUSALS,
    ),
    Relation(
        ("offload", "offload_overlap", "offload_defer", "cp"),
        "refused",
        "--optimizer-offload-defer with --cp {cp}: not supported (the distributed optimizer shards over the "
        "data- and context-parallel ranks and all-gathers the updated shards right after its step, which a "
        "deferred host step cannot feed); drop --optimizer-offload-defer or use --cp 1",
        _REFUSALS,
    ),
    Relation(
        ("offload", "cuda_graph"),
        "refused",
        "--optimizer-cpu-offload with --cuda-graph: not supported (the graphs capture forward+backward; the "
        "offloaded step and its host copies stay eager, but megatron's hybrid optimizer was not tested with the "
        "graphed runner); drop one of them",
        "tests/test_optimizer_offload.py::test_cli_flags",
    ),
    Relation(
        ("activation_offload", "cuda_graph"),
        "refused",
        "--offload-activations with --cuda-graph: not supported (a captured step would allocate its pinned host "
        "buffers during the capture and replay copies into buffers it does not own); drop one of them",
        _REFUSALS,
    ),
    Relation(
        ("cuda_graph", "pp"),
        "refused",
        _GRAPH_ONE_RANK,
        "tests/test_train_cuda_graph.py::test_rejects_what_cannot_be_captured",
    ),
    Relation(
        ("cuda_graph", "ep"),
        "refused",
        _GRAPH_ONE_RANK,
        "tests/test_train_cuda_graph.py::test_rejects_what_cannot_be_captured",
    ),
    Relation(("cuda_graph", "tp"), "refused", _GRAPH_ONE_RANK, _REFUSALS),
    # refused: decided when the run starts
    Relation(
        ("cuda_graph", "cpu"),
        "refused",
        "--cuda-graph needs a CUDA device (none is visible); drop --cuda-graph on CPU",
        "tests/test_train_cuda_graph.py::test_needs_a_cuda_device",
    ),
    Relation(
        ("activation_offload", "cpu"),
        "refused",
        "--offload-activations needs a CUDA device (none is visible; on the CPU the activations are in host memory "
        "already); drop --offload-activations",
        _REFUSALS,
    ),
    Relation(
        ("cuda_graph", "fp32"),
        "refused",
        "--cuda-graph needs bf16 (the default on CUDA): the fp32 expert GEMMs read their row counts on the host, "
        "which a captured step cannot; drop --no-bf16 or --cuda-graph",
        "tests/test_train_cuda_graph.py::test_rejects_what_cannot_be_captured",
    ),
    Relation(
        ("cuda_graph", "packed", "dp"),
        "refused",
        "--cuda-graph --packed runs on one process (DP={dp}): the dp-balanced scheduler gives the data-parallel "
        "ranks different micro-batch counts, and every rank must replay the same captured step; drop --packed "
        "(fixed-length [B, S] batches graph under DP) or --cuda-graph",
        "tests/test_train_cuda_graph.py::test_data_parallel_is_accepted_model_parallel_is_not",
    ),
    Relation(
        ("offload", "offload_overlap", "offload_defer", "dp"),
        "refused",
        "--optimizer-offload-defer runs on one data-parallel rank (got DP={dp}): the distributed optimizer "
        "all-gathers the updated param shards right after its step, which a deferred host step cannot feed; drop "
        "--optimizer-offload-defer",
        _REFUSALS,
    ),
    # supported, with the test that runs the combination
    Relation(
        ("dp",),
        "supported",
        "DP2 equals one process, from the same --seed (same initial model, fp32, bf16)",
        _MATRIX,
    ),
    Relation(
        ("tp",),
        "supported",
        "TP2 (sequence parallelism, micro-batches of one sequence; DSv4 attention W C H with its heads split, '-', "
        "'E', mHC + MTP) equals one process from the same --seed, from the CLI (megatron's '*': model-level test)",
        "tests/test_train_tensor_parallel.py::test_tp2_from_the_cli_starts_like_one_process",
    ),
    Relation(
        ("tp",),
        "supported",
        "TP4 (4 ranks, a model with 4 output-projection groups: model_overrides o_groups 4 on tiny in a --config "
        "file) trains 3 steps like one process from the same --seed, from the CLI (fp32, bf16)",
        _TP4 + "test_tp4_from_the_cli_trains_like_one_process_fp32",
    ),
    Relation(
        ("tp",),
        "supported",
        "dsv4 convert HF OUT --tp 4 then dsv4 train --init-from OUT --tp 4 trains 3 steps like one process "
        "--init-from the TP1 conversion of the same HF checkpoint, from the CLI (fp32)",
        _TP4_CKPT + "test_tp4_conversion_trains_at_tp4_like_one_process_from_the_tp1_conversion",
    ),
    Relation(
        ("resume", "tp"),
        "supported",
        "TP2 saved at step k and resumed equals the uninterrupted TP2 run bitwise (losses, final weights; fp32, bf16; "
        "both --ckpt-format values), from the CLI",
        "tests/test_train_tp_resume.py::test_same_tp_resume_is_bitwise",
    ),
    Relation(
        ("resume", "tp"),
        "supported",
        "--ckpt-format fully_reshardable resumes at another TP size (TP2 -> TP1, TP1 -> TP2; optimizer state "
        "resharded) like the uninterrupted runs, from the CLI; a dp_reshardable checkpoint refuses a TP change "
        "when it is loaded (its flat optimizer buffers follow the TP shard sizes)",
        "tests/test_train_tp_resume.py::test_resume_at_another_tp_size_continues_the_saved_run",
    ),
    Relation(
        ("resume", "tp"),
        "supported",
        "a one-process --ckpt-format fully_reshardable checkpoint resumes at TP4 (TP1 -> TP4) like the one-process "
        "continuation and the uninterrupted TP4 run, from the CLI (fp32)",
        _TP4 + "test_tp1_checkpoint_resumes_at_tp4_like_the_one_process_continuation",
    ),
    Relation(
        ("resume", "tp"),
        "supported",
        "TP4 saved at step 2 and resumed at TP4 equals the uninterrupted TP4 run bitwise (losses, weights, fp32 "
        "main params, Adam moments), from the CLI (fp32)",
        _TP4_CKPT + "test_tp4_resume_at_tp4_is_bitwise",
    ),
    Relation(
        ("resume", "tp"),
        "supported",
        "a one-process bf16 --ckpt-format fully_reshardable checkpoint resumes at TP4 (TP1 -> TP4) within the bf16 "
        "bound of the one-process continuation, from the CLI",
        _TP4_CKPT + "test_bf16_tp1_checkpoint_resumes_at_tp4_within_the_bf16_bound",
    ),
    Relation(
        ("resume", "tp"),
        "supported",
        "a TP4 bf16 --ckpt-format fully_reshardable checkpoint resumes in one process (TP4 -> TP1) within the bf16 "
        "bound of the uninterrupted TP4 run and of one process, and continues its fp32 main params and Adam moments "
        "(step 3's update derived from the saved step-2 state), from the CLI",
        _TP4_CKPT + "test_bf16_tp4_checkpoint_resumes_in_one_process_within_the_bf16_bound",
    ),
    Relation(
        ("tp", "dp"), "supported", "TP2 x DP2 equals one process, from the CLI (fp32, bf16)", _TP_COMBOS
    ),
    Relation(
        ("tp", "pp"),
        "supported",
        "TP2 x PP2 equals one process, from the CLI (fp32, bf16): the mHC streams cross stages as sequence shards "
        "[s/tp, b, n·d]",
        _TP_COMBOS,
    ),
    Relation(
        ("tp", "vpp"),
        "supported",
        "TP2 x PP2 x VPP2 equals one process, from the CLI (fp32, bf16): folded streams [(s/tp)·n, b, d]",
        _TP_COMBOS,
    ),
    Relation(
        ("tp", "ep"),
        "supported",
        "TP2 x EP2 equals one process, from the CLI (fp32, bf16): each TP rank's sequence shard through the expert "
        "all-to-all, expert TP 1",
        _TP_COMBOS,
    ),
    Relation(
        ("tp", "packed"),
        "supported",
        "TP2 on packs (the pack's documents cut into sequence-parallel shards: DSv4 attention's TP layout, the MTP "
        "roll on the whole pack, the routers' per-document balance loss summed over TP) equals one process --packed "
        "from the same --seed, from the CLI (fp32, bf16)",
        _TP + "test_tp2_packed_from_the_cli_trains_like_one_process",
    ),
    Relation(
        ("tp", "micro_batch"),
        "supported",
        "TP2 with [B, S] micro-batches of B > 1 sequences (run as a THD pack of B documents of S tokens) equals one "
        "process with the same micro-batch size, from the same --seed, from the CLI (fp32, bf16)",
        _TP + "test_tp2_micro_batches_from_the_cli_train_like_one_process",
    ),
    Relation(
        ("pp",),
        "supported",
        "PP2 equals one process, from the same --seed (same initial model, fp32, bf16)",
        _MATRIX,
    ),
    Relation(
        ("ep",),
        "supported",
        "EP2 equals one process, from the same --seed (same initial model, fp32, bf16)",
        _MATRIX,
    ),
    Relation(
        ("cp",),
        "supported",
        "CP2 equals CP1 (packed and [B, S], fp32, bf16); [B, S] from the same --seed (same initial model)",
        _CP + "test_cp2_matches_cp1",
    ),
    Relation(
        ("tp", "cp"),
        "supported",
        "TP2 x CP2 (sequence parallelism inside each CP chunk) equals one process from the same --seed, from the "
        "CLI (fp32, bf16); --seq-len a multiple of cp x tp",
        _TPCP,
    ),
    Relation(
        ("tp", "cp", "packed"),
        "supported",
        "TP2 x CP2 on packs of several documents (sharded over CP as by --cp alone, cut over TP by the model) equals "
        "one process --packed (fp32, bf16)",
        _TPCP,
    ),
    Relation(
        ("tp", "cp", "micro_batch"),
        "supported",
        "TP2 x CP2 with [B, S] micro-batches of B = 3 sequences (one THD pack of B documents, cut over CP then TP) "
        "equals one process (fp32, bf16)",
        _TPCP,
    ),
    Relation(
        ("tp", "cp", "ep"),
        "supported",
        "TP2 x CP2 x EP2 (4 ranks; expert groups over the TP x CP ranks, expert TP 1, expert DP 2) equals one process "
        "from the CLI: fp32 from a 'dsv4 convert --tp 2 --ep 2' conversion (one process from the TP 1 conversion), "
        "bf16 from the same --seed",
        _TPCPEP + "test_tp2xcp2xep2_from_a_tp2_ep2_conversion_equals_one_process",
    ),
    Relation(
        ("tp", "cp", "pp"),
        "supported",
        "TP2 x CP2 x PP2 (8 ranks; the stage-to-stage streams are the CP chunk's sequence-parallel shard "
        "[s/(cp·tp), b, n·d]) equals one process on the same global batch from the same --seed, from the CLI "
        "(fp32, bf16); --seq-len a multiple of cp x tp",
        _TPCP8 + "test_tp2xcp2xpp2_from_the_cli_equals_one_process",
    ),
    Relation(
        ("tp", "cp", "dp"),
        "supported",
        "TP2 x CP2 x DP2 (8 ranks; DP replicates the TP x CP model, gradients reduced over DP x CP) equals one "
        "process on the same global batch from the same --seed, from the CLI (fp32, bf16)",
        _TPCP8 + "test_tp2xcp2xdp2_from_the_cli_equals_one_process",
    ),
    Relation(
        ("pp", "vpp"),
        "supported",
        "PP2 x VPP2 equals one process, from the same --seed (same initial model; also from the CLI)",
        _MATRIX,
    ),
    Relation(("pp", "packed"), "supported", "PP2 on packed batches equals one process", _MATRIX),
    Relation(("dp", "ep"), "supported", "DP2 x EP2 equals one process", _MATRIX),
    Relation(("dp", "pp"), "supported", "DP2 x PP2 equals one process", _MATRIX),
    Relation(("pp", "ep"), "supported", "PP2 x EP2 equals one process", _MATRIX),
    Relation(("cp", "packed"), "supported", "CP2 on packs equals CP1", _CP + "test_cp2_matches_cp1"),
    Relation(("cp", "pp"), "supported", "CP2 x PP2 equals CP1", _CP + "test_cp2_with_pp2_or_ep2_matches_cp1"),
    Relation(("cp", "ep"), "supported", "CP2 x EP2 equals CP1", _CP + "test_cp2_with_pp2_or_ep2_matches_cp1"),
    Relation(("cp", "dp"), "supported", "CP2 x DP2 equals CP1", _CP + "test_cp2_with_dp2_matches_cp1"),
    Relation(("eval", "dp"), "supported", "evaluation under DP2 equals one process", _EVAL),
    Relation(("eval", "pp"), "supported", "evaluation under PP2 equals one process", _EVAL),
    Relation(("eval", "vpp"), "supported", "evaluation under PP2 x VPP2 equals one process", _EVAL),
    Relation(("eval", "cp"), "supported", "evaluation under CP2 equals one process", _EVAL),
    Relation(
        ("cuda_graph", "dp"),
        "supported",
        "the DP reduction after the graphed step equals eager DP2 (CPU); graphed DP2 = eager DP2 bitwise (GPU)",
        "tests/test_train_graph_dp.py::test_split_step_equals_dp2_and_single_process",
    ),
    Relation(
        ("cuda_graph", "packed"),
        "supported",
        "a packed step captured on one pack replays another (CPU) and trains like eager (GPU)",
        "tests/test_train_cuda_graph_packed.py::test_packed_step_captured_on_one_pack_replays_another",
    ),
    Relation(
        ("cuda_graph", "recompute"),
        "supported",
        "graphed recompute trains like eager (GPU)",
        "tests/test_train_cuda_graph.py::test_graphed_recompute_matches_eager",
    ),
    Relation(
        ("recompute", "pp"),
        "supported",
        "PP2 with recompute: gradients bitwise those without",
        "tests/test_recompute.py::test_pp2_recompute_gradients_bitwise",
    ),
    Relation(
        ("activation_offload", "recompute"),
        "supported",
        "full recompute with what the forward saves moved through the hooks: losses and gradient norms bitwise "
        "those without them (CPU, CPU tensors copied the same way; the CUDA run from the CLI, "
        "test_activation_offload_gpu.py, bitwise on an H100, 2026-12-07)",
        "tests/test_activation_offload.py::test_full_recompute_steps_through_the_hooks_equal_the_plain_steps",
    ),
    Relation(
        ("fused_step",),
        "supported",
        "clipping, AdamW and the bf16 model-param copy in one Triton pass: steps equal megatron's own (distributed "
        "and plain optimizer, clipping on and off; CPU interpreter)",
        "tests/test_optimizer_fused_step.py::test_parity_with_megatron_adam",
    ),
    Relation(
        ("fused_step", "resume"),
        "supported",
        "resumes bit for bit, also into and from the other --optimizer-impl choices (same checkpoint format)",
        "tests/test_optimizer_fused_step.py::test_train_exact_resume_and_cross_impl_resume",
    ),
    Relation(
        ("offload", "dp"),
        "supported",
        "the offloaded optimizer under DP2",
        "tests/test_optimizer_offload.py::test_dp2_offload",
    ),
    Relation(
        ("offload", "offload_overlap"),
        "supported",
        "the pipelined host step (chunked D2H / CPU AdamW / H2D) is bitwise megatron's offloaded step: params, "
        "masters, moments, steps after 3 steps (bf16 and FP32 params, F = 1 and < 1, clipping; CPU, simulated "
        "device; on CUDA, test_offload_overlap_gpu.py, bitwise on an H100, 2026-12-07; 1.15 s instead of 2.98 s "
        "for flash-smoke's 3.81 B parameters there)",
        "tests/test_offload_pipeline.py::test_pipeline_bitwise_equals_megatron_step",
    ),
    Relation(
        ("offload", "offload_overlap", "resume"),
        "supported",
        "checkpoints interchangeable with the unpipelined offload (saved by either, resumed by either, bitwise)",
        "tests/test_offload_pipeline.py::test_pipeline_checkpoint_round_trip",
    ),
    Relation(
        ("offload", "offload_overlap", "dp"),
        "supported",
        "DP2: each rank pipelines the host step of its own shards, bitwise the non-offloaded run",
        "tests/test_offload_pipeline.py::test_dp2_pipeline",
    ),
    Relation(
        ("offload", "offload_overlap", "offload_defer"),
        "supported",
        "the host AdamW of step k runs behind step k+1's forward (each module waits for its own params): losses, "
        "grad norms, the values each forward reads, params, masters, moments and steps are bitwise the pipelined "
        "step's after 3 steps (F = 1 and 0.5, a slowed host thread; CPU, simulated device; and on CUDA: "
        "test_offload_defer_gpu.py passed on an H100)",
        "tests/test_offload_defer.py::test_deferred_steps_bitwise_equal_pipelined",
    ),
    Relation(
        ("offload", "offload_overlap", "offload_defer", "resume"),
        "supported",
        "a checkpoint saved while a step is deferred resumes pipelined and vice versa, bitwise (same format)",
        "tests/test_offload_defer.py::test_deferred_checkpoint_resumes_in_either_mode",
    ),
    Relation(
        ("deterministic", "cuda_graph"),
        "supported",
        "deterministic runs (the default with CUDA) are bitwise identical, eager and graphed (GPU)",
        "tests/test_train_deterministic_flag.py::test_deterministic_runs_are_bitwise_identical_on_gpu",
    ),
)


__all__ = ["RELATIONS"]
