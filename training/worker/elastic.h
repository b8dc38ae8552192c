// training/worker/elastic.h — defines the elastic protocol between the driver of a
// distributed training job and its workers (docs/elastic.md), and the worker's side of it.
//
// Messages (typed, training/messages.h) between the Trainer's "trainer" actor and
// each worker's actors (role_actors.h): StepCommand {seq, kind, step, epoch} to every
// "stage.<rank>" (seqs continue across epochs), StepReply from every rank (rank 0's
// carries the step metrics; snapshot and checkpoint notes from all), WorkerFailure (a
// data-plane or join failure in an epoch: code, actor, text, time, the snapshot a restore
// could not use), SnapshotLanded (a rank's snapshot part is in its keeper) and
// SnapshotCommitted (every part landed; to every stage actor).
// Keys, all under "<job>/elastic/" in the job's rendezvous store (not epoch-namespaced:
// they span epochs; a worker blocked in a collective still sees them, and they survive a
// scheduler restart):
//   plan/<e>            ElasticPlan of membership epoch e (written by the driver; e = 0 too)
//   actors/<slot>       a worker's actor-system node and endpoint; actors/driver the driver's
//   adopted/<e>/<slot>  the worker took plan e over (it is rebuilding)
//   ready/<e>/<slot>    the worker joined epoch e (communicators built, state restored)
//   hb/<slot>           heartbeat counter (rewritten every kHeartbeatInterval)
//   fault/<slot>        fault injection: wall time (ms) just before the injected fault
// Snapshots (elastic.snapshot_every; training/checkpointing/snapshots.h): each rank copies its
// state into memory its node's keeper holds, off the step; the driver commits a snapshot
// once every rank's part landed (snapshot_ledger.h). Checkpoints (checkpoint.every; the
// directory is in the plan) are written from the committed snapshot of the step by each
// rank's writer thread, in the checkpoint format of normal training, and a later reply says
// so once the part is durable; the driver finalizes the checkpoint once every rank's is.
// `train_moe train --resume` loads it into any layout.
// A slot names one worker process for its whole life; its rank may change when the job
// is rescaled. A replacement is a new slot.
//
// Commands in flight: the Trainer keeps up to train.steps_in_flight step commands in
// flight (step k+1 is sent before step k's reply arrives), so a worker finds its next
// command queued when it finishes a step and never idles for a driver round trip. The
// worker serves them in order; on a device, where the Stage can (Stage::can_launch_ahead)
// and nothing between two steps needs the state (no snapshot or checkpoint due after the
// step), it launches step k+1 before finishing step k (on the CPU launch_step runs the
// whole step: launching ahead would only hold the step's report back). Each reply says
// whether the next command was already queued when it was sent (next_queued) and how long
// the worker waited for this one.
//
// Worker contract: between commands the worker serves its queue; when plan/<e+1> appears
// (its watcher thread polls it) it aborts every communicator, so a step in progress unwinds
// (CommFailure), drops what was queued or launched, rebuilds its communicators in epoch
// e+1 (or re-creates its Stage when its rank or dp changes), restores what the plan names
// (a snapshot's parts through its node's keeper, a checkpoint, or its own live state after
// plan.step_done), writes ready/<e+1>/<slot> (with the step it restored) and serves
// commands from plan.seq on. A slot missing from the plan exits 0 (scale-down).
// Which state: plan.step_done is at most the last step every rank reported to the Trainer.
// With commands in flight a survivor may have completed later steps whose reports had not
// arrived: a plan that restores a snapshot or a checkpoint takes every rank back to it, and
// a plan that keeps the live state is refused by a rank that is not exactly at step_done
// (the Trainer then restores the newest snapshot).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/rendezvous_store.h"
#include "core/status.h"
#include "layers/context.h"
#include "observe/health.h"
#include "training/messages.h"
#include "training/parallel/elastic_comm.h"
#include "training/run_config.h"
#include "training/stage/stage_program.h"
#include "training/tolerant_store.h"

namespace troupe::actors {
class ActorSystem;
}

namespace troupe::training {

inline constexpr std::chrono::milliseconds kHeartbeatInterval{100};

// ElasticPlan (the plan of a membership epoch) is a typed message: messages.h.

std::string elastic_key(const std::string& job, const std::string& rest);  // "<job>/elastic/<rest>"
int64_t wall_ms();  // system clock, ms since the epoch (events, fault times)

// Fault injection (test.inject): FaultSpec and parse_faults are in
// training/parallel/elastic_comm.h, next to the fault points they fire at.

// The worker process: serves the job under the elastic protocol until "stop" (or until
// the plan leaves it out). `tc` is the job's configuration; the plan overrides dp and
// grad_accum.
// `cut_control` (may be empty) closes the worker's connection to its control plane, for
// the cutctl fault.
// `ctx`: where the Stage lives (the CPU, or this worker's GPU: NCCL communicators).
// `program`: the app's stage program (stage_program.h), built for each Stage.
// `driver_system`: a worker in the driver's own process (a one-process run, trainer.h):
// its actors join the driver's actor system (no socket); null: its own system, reached
// over the control plane. `steps` (may be null): fed each step's timings and each
// checkpoint's blocked time, for the worker's health reports (scheduler/client/health_reporter.h).
Status run_elastic_worker(const layers::TrainConfig& tc, const ProgramFactory& program,
                          comm::RendezvousStore& store, const std::string& job, int slot, uint64_t epoch,
                          std::function<void()> cut_control = {}, const layers::Ctx& ctx = layers::Ctx::cpu(),
                          actors::ActorSystem* driver_system = nullptr, observe::StepProbe* steps = nullptr);

}  // namespace troupe::training
