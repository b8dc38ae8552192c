// actors/training/elastic.h — defines the elastic protocol between the driver of a
// distributed training job and its workers (docs/elastic.md), and the worker's side of it.
//
// Messages (typed, actors/training/messages.h) between the Trainer's "trainer" actor and
// each worker's actors (role_actors.h): StepCommand {seq, kind, step, epoch} to every
// "stage.<rank>" (seqs continue across epochs), StepReply from every rank (rank 0's
// carries the step metrics; checkpoint and replica notes from all), WorkerFailure (a
// data-plane or join failure in an epoch: code, actor, text, time).
// Keys, all under "<job>/elastic/" in the job's rendezvous store (not epoch-namespaced:
// they span epochs; a worker blocked in a collective still sees them, and they survive a
// scheduler restart):
//   plan/<e>            ElasticPlan of membership epoch e (written by the driver; e = 0 too)
//   actors/<slot>       a worker's actor-system node and endpoint; actors/driver the driver's
//   adopted/<e>/<slot>  the worker took plan e over (it is rebuilding)
//   ready/<e>/<slot>    the worker joined epoch e (communicators built, state restored)
//   hb/<slot>           heartbeat counter (rewritten every kHeartbeatInterval)
//   held/<e>/<slot>     a survivor's committed steps when epoch e opened (JSON list)
//   fault/<slot>        fault injection: wall time (ms) just before the injected fault
// Checkpoints (checkpoint.every = K; the directory is in the plan): after
// every K-th step each rank saves its part of issue 8's checkpoint format (the same
// Stage::export_state(kSave) + RankCheckpointer as normal training, stage_state.h) in the
// background, and a later reply says so once the part is durable; the driver finalizes
// the checkpoint once every rank's is. `train_moe train --resume` loads it into any layout.
// A slot names one worker process for its whole life; its rank may change when the job
// is rescaled. A replacement is a new slot.
//
// Commands in flight: the Trainer keeps up to train.steps_in_flight step commands in
// flight (step k+1 is sent before step k's reply arrives), so a worker finds its next
// command queued when it finishes a step and never idles for a driver round trip. The
// worker serves them in order; where the Stage can (Stage::can_launch_ahead) and nothing
// between two steps needs the state (no in-memory commit, no checkpoint part) it launches
// step k+1 before finishing step k. Each reply says whether the next command was already
// queued when it was sent (next_queued) and how long the worker waited for this one.
//
// Worker contract: between commands the worker serves its queue; when plan/<e+1> appears
// (its watcher thread polls it) it aborts every communicator, so a step in progress
// unwinds (CommFailure), drops what was queued or launched, rolls back to the committed
// state the new epoch restores, rebuilds its communicators in epoch e+1 (or re-creates its
// Stage when dp changes), takes part in the state broadcast from a survivor of its (pp, n)
// column, writes ready/<e+1>/<slot> (with the step it restored) and serves commands from
// plan.seq on. A slot missing from the plan exits 0 (scale-down).
// Which state: the plan's step_done is the last step every rank reported to the Trainer;
// with commands in flight a survivor may have completed (and committed) later steps whose
// reports had not arrived, and no longer hold step_done among its two committed states. So
// the ranks agree: each survivor holding state writes held/<e+1>/<slot> (its committed
// steps) and every rank restores restore_step(step_done, all of them).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "actors/training/messages.h"
#include "actors/training/stage_program.h"
#include "actors/training/tolerant_store.h"
#include "comm/rendezvous_store.h"
#include "core/status.h"
#include "layers/context.h"
#include "layers/train_config.h"
#include "observe/health.h"

namespace troupe::actors {
class ActorSystem;
}

namespace troupe::training {

inline constexpr std::chrono::milliseconds kHeartbeatInterval{100};

// ElasticPlan (the plan of a membership epoch) is a typed message: messages.h.

std::string elastic_key(const std::string& job, const std::string& rest);  // "<job>/elastic/<rest>"
int64_t wall_ms();  // system clock, ms since the epoch (events, fault times)

// Whether the workers keep their committed state in memory (rollback of survivors, a
// replacement restored from its dp peer, rescaling): always on the CPU; on GPUs when the
// job is data-parallel (parallel.dp or elastic.max_dp > 1) and elastic.gpu_state is
// "memory" (the default). Without a dp peer nobody could
// restore from it on a GPU (the neighbour replicas are CPU-only), and the per-step device
// copies (values and the column's moments, two generations) would be pure cost: such a
// job restores the last checkpoint.
bool keeps_state_in_memory(const layers::TrainConfig& tc, bool gpu);

// The step a new epoch restores when its survivors roll back: the oldest step, not older
// than `step_done` (the last one every rank reported), that every survivor holding state
// still holds (`held`: each one's committed steps). The ranks of a job finish steps within
// one step of each other (every step ends in a collective over the world), so with W
// commands in flight such a step exists. FailedPrecondition naming every survivor's steps
// when none does. No survivor: step_done.
Result<int64_t> restore_step(int64_t step_done, const std::vector<std::vector<int64_t>>& held);

// Fault injection (tests/elastic, the demo): elastic.inject = "<action>@<step>:<phase>:<slot>[,...]" with
// action kill (SIGKILL), stop (SIGSTOP), slow (sleeps 150 ms there at that step and
// every later one: a straggler), cut (aborts the worker's own communicators: its data-plane
// connections close, the process lives on) or hang (the step thread blocks forever while
// the process keeps its heartbeat: only the step watchdog sees it) or cutctl (the worker's
// connection to the control plane is closed: under troupe-scheduler its store session;
// it keeps computing but can neither beat nor take commands), phase forward (the first attention all-to-all
// of the step), alltoall (the first MoE dispatch all-to-all), sync (gradient
// reduce-scatter), checkpoint (while the elastic checkpoint of the step is being written
// in the background) or any (the first data-plane wait of the step); slow@0:start:<slot>
// instead delays the worker's start by twice the heartbeat timeout before its first beat
// (a slow start is not a silent worker). Only processes started in epoch 0 inject (a
// replacement never repeats its predecessor's fault).
struct FaultSpec {
  enum class Action { kKill, kStop, kSlow, kCut, kHang, kCutControl } action = Action::kKill;
  int64_t step = 0;
  std::string phase;
  int slot = 0;
};
Result<std::vector<FaultSpec>> parse_faults(const std::string& spec);

// The worker process: serves the job under the elastic protocol until "stop" (or until
// the plan leaves it out). `tc` is the job's configuration; the plan overrides dp and
// grad_accum.
// `cut_control` (may be empty) closes the worker's connection to its control plane, for
// the cutctl fault.
// `ctx`: where the Stage lives (the CPU, or this worker's GPU: NCCL communicators; no
// in-memory copy of the committed state is kept there yet, so a lost GPU worker is
// restored from the last checkpoint).
// `program`: the app's stage program (stage_program.h), built for each Stage.
// `driver_system`: a worker in the driver's own process (a one-process run, trainer.h):
// its actors join the driver's actor system (no socket); null: its own system, reached
// over the control plane. `steps` (may be null): fed each step's timings and each
// checkpoint's blocked time, for the worker's health reports (scheduler/health_reporter.h).
Status run_elastic_worker(const layers::TrainConfig& tc, const ProgramFactory& program,
                          comm::RendezvousStore& store, const std::string& job, int slot, uint64_t epoch,
                          std::function<void()> cut_control = {}, const layers::Ctx& ctx = layers::Ctx::cpu(),
                          actors::ActorSystem* driver_system = nullptr, observe::StepProbe* steps = nullptr);

}  // namespace troupe::training
