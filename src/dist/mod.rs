//! Processes working on one step together: the [`Comm`] seam and the collectives built on it.
//!
//! A `Comm` is a group of ranks that can exchange bytes pairwise ([`Comm::sendrecv`]); the
//! collectives data parallelism and ZeRO need (all-reduce, reduce-scatter, all-gather) are
//! written once over it in [`ring`], so every transport reduces in the same fixed order
//! (runs are deterministic), works in place on plan buffers with one planned scratch piece
//! (no allocation during a step), sums bf16 and f16 in f32, and counts the bytes it sends
//! exactly (the plan's `comm_bytes_per_step` is checked against that count).
//!
//! Transports:
//! - [`Single`]: one process (rank 0 of 1); every collective is a copy or nothing.
//! - [`Local`]: ranks as threads of one process, over channels (tests, and `--ranks N` runs
//!   that want no MPI).
//! - `Mpi` (cargo feature `mpi`): ranks as processes started by `mpirun`, over MPI's
//!   point-to-point `MPI_Sendrecv` (rsmpi). NCCL comes with the CUDA backend behind the same
//!   trait.
//!
//! [`Comms`] gives one communicator per axis of the job's mesh ([`crate::ir::Mesh`]): a
//! [`Group`] renumbers the ranks along an axis over the job's transport, so the collectives
//! run on any axis unchanged.
//!
//! [`world`] picks the transport (and refuses `--zero 1–3` outside `mpirun`, or `mpirun`
//! without the feature); [`comm_thread_wanted`] says whether collectives get a thread of their
//! own; how a group's elements are cut among ranks is [`crate::ir::shard`]'s. In a run under `mpirun`,
//! rank 0 owns the run directory (the others write `metrics.rank{r}.jsonl`), the ranks compare
//! a hash of their options and resume point before anything is written, and a rank that
//! fails with an error prints it and aborts the job ([`Comm::abort`]).
//!
//! **Invariant:** ranks exchange state only through the plan's `AllReduce`, `ReduceScatter`
//! and `AllGather` ops, and a pipeline stage's `StageSend` and `StageRecv`
//! ([`Comm::send`], [`Comm::recv`]), on plan buffers (and the step's few scalars), so a rank's memory and
//! traffic are predicted like everything else (`plan::zero`). Each collective runs beside the
//! ops after it (the device's communication thread, or a GPU's stream) until its
//! `AwaitCollective`, and no op in between touches its buffers (verified when the plan is
//! built). Checkpoints never depend on the number of ranks: rank 0 writes the whole state,
//! receiving each piece from the rank that owns it (its ZeRO shard along the data axis, its
//! part of a cut tensor along the tensor axis, both at once under `--tp` with `--zero`) over
//! the job's [`Comm::sendrecv`] as its writer reads them (`exec::executor`'s checkpoints),
//! and a run resumes on any number of ranks, tensor ranks included.

mod comm;
pub mod group;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod ring;

pub use comm::{Comm, Single};
pub use group::{Comms, Group};
pub use local::Local;
pub use ring::Summable;

use anyhow::Result;

/// Whether collectives should run on a communication thread beside compute: only where the
/// thread has a core of its own. The ranks on this machine (as the launcher says: Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's `MPI_LOCALNRANKS`; else all of `ranks`), each with
/// `threads` compute threads and one for communication, must fit in the cores this process
/// may use; otherwise the thread, which copies and adds while it waits on its peers, would
/// take its core from compute (measured: 3–10% slower on 2 cores with 2 ranks of 1 thread).
/// `MEMWALL_COMM_THREAD=1` or `=0` decides instead. Returns the choice and why.
pub fn comm_thread_wanted(threads: usize, ranks: usize) -> (bool, String) {
    if let Ok(v) = std::env::var("MEMWALL_COMM_THREAD") {
        let on = !matches!(v.trim(), "0" | "off" | "false" | "no");
        return (on, format!("MEMWALL_COMM_THREAD={}", v.trim()));
    }
    let local = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
        .unwrap_or(ranks);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let need = local * (threads + 1);
    (
        need <= cores,
        format!(
            "{local} ranks here x ({threads} + 1) threads, {}",
            crate::util::count(cores as u64, "core")
        ),
    )
}

/// The environment variables a process started by an MPI launcher has (Open MPI, MPICH,
/// PMIx).
const LAUNCHER_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"];

/// Whether this process was started by `mpirun` (or `mpiexec`, `srun`): known without MPI,
/// so a build without the `mpi` feature can refuse to run as N independent copies.
pub fn launched() -> bool {
    LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some())
}

/// The ranks this process belongs to: `MPI_COMM_WORLD` when started by `mpirun` (in a
/// build with the `mpi` feature), else one process. `zero` is the `--zero` flag: a stage
/// that shards (1 to 3) is refused outside `mpirun` with how to run it; `--zero 0` is one
/// process's plain training (e.g. resuming a sharded run alone).
pub fn world(zero: Option<crate::ir::Zero>) -> Result<std::sync::Arc<dyn Comm>> {
    #[cfg(not(feature = "mpi"))]
    const BUILD: &str = "cargo build --release --features mpi (needs Open MPI or MPICH and libclang: apt-get install openmpi-bin libopenmpi-dev libclang-dev)";
    if launched() {
        #[cfg(feature = "mpi")]
        return Ok(std::sync::Arc::new(mpi::Mpi::init()?));
        #[cfg(not(feature = "mpi"))]
        anyhow::bail!(
            "this memwall was built without MPI, yet mpirun started it: each process would train alone and write the same run directory; build it with `{BUILD}`"
        );
    }
    if let Some(z) = zero.filter(|z| z.shards_optimizer()) {
        #[cfg(feature = "mpi")]
        let how = String::new();
        #[cfg(not(feature = "mpi"))]
        let how = format!(", with a memwall built by `{BUILD}`");
        anyhow::bail!(
            "--zero {z} spreads the model's state over processes: start them with `mpirun -np N memwall train ... --zero {z}` (N >= 2){how}; `memwall plan --ranks N --zero {z}` shows a rank's plan without MPI"
        );
    }
    Ok(std::sync::Arc::new(Single))
}
