// core/job_env.h — every environment variable a Troupe launcher hands the processes it
// starts (troupe-scheduler and its agents, the standalone launcher of a training app),
// named once: the spawner side (scheduler/daemons/scheduler.cc, scheduler/daemons/agent.cc,
// training/driver/trainer.cc) sets them and the reader side (scheduler/client/job_context.cc,
// comm/control/host_addr.h, training/...) reads them through core/env.h with these
// constants. docs/cluster.md ("What each process gets") lists them for users. No secret
// travels here: the job's CURVE secret key is a 0600 file whose path is kJobSecretKeyFile.
#pragma once

namespace troupe::job_env {

// ---- who the process is ----
inline constexpr const char* kRole = "TROUPE_ROLE";           // "driver" or "worker"
inline constexpr const char* kJobId = "TROUPE_JOB_ID";        // set: the process was started by Troupe
inline constexpr const char* kProcName = "TROUPE_PROC_NAME";  // "driver", "worker-3"
// A worker's rank, which is also its elastic slot (the driver's membership plans place
// slots); -1 for the driver.
inline constexpr const char* kRank = "TROUPE_RANK";
inline constexpr const char* kWorldSize = "TROUPE_WORLD_SIZE";  // workers of the job
inline constexpr const char* kLocalRank = "TROUPE_LOCAL_RANK";  // among the job's workers on this node
inline constexpr const char* kLocalWorldSize = "TROUPE_LOCAL_WORLD_SIZE";  // the job's workers on this node
// The scheduler's incarnation of the job's processes: bumped each time it restarts the
// job's workers (or driver); heartbeats and placements carry it, so an old process is told
// apart from its replacement.
inline constexpr const char* kEpoch = "TROUPE_EPOCH";
// The driver's membership epoch a worker joins (the training driver's plans, which change
// on every replacement and rescale without the scheduler restarting anything); unset: 0,
// the first plan. Only a worker the driver asked for (a replacement, a new replica) gets it.
inline constexpr const char* kMembershipEpoch = "TROUPE_ELASTIC_EPOCH";
inline constexpr const char* kRestarts = "TROUPE_RESTARTS";               // worker restarts of the job so far
inline constexpr const char* kDriverRestarts = "TROUPE_DRIVER_RESTARTS";  // > 0: a restarted driver resumes

// ---- what the job was submitted with (troupe run/submit flags) ----
// --layout, when the job was submitted with one ("pp=2,dp=2,n=1"): an app's own layout
// (its config with --parallel) must be the same; an app without --parallel takes it.
inline constexpr const char* kLayout = "TROUPE_LAYOUT";
// --backend ("cpu" or "cuda"): an app's own --backend must be the same; an app without
// --backend takes it.
inline constexpr const char* kBackend = "TROUPE_BACKEND";
inline constexpr const char* kCheckpointDir = "TROUPE_CHECKPOINT_DIR";             // --checkpoint-dir
inline constexpr const char* kHeartbeatMs = "TROUPE_HEARTBEAT_MS";                 // suggested beat interval
inline constexpr const char* kHeartbeatTimeoutMs = "TROUPE_HEARTBEAT_TIMEOUT_MS";  // --heartbeat-timeout-ms

// ---- where it runs and whom it talks to ----
inline constexpr const char* kScheduler =
    "TROUPE_SCHEDULER";                              // the scheduler's endpoint (also the CLI's default)
inline constexpr const char* kNode = "TROUPE_NODE";  // the agent's id
// The agent's device slot the process was placed on (with --backend cuda also its
// CUDA_VISIBLE_DEVICES).
inline constexpr const char* kDeviceSlot = "TROUPE_SLOT";
// The agent's relay (ipc://...): the process's scheduler sessions go there, without CURVE.
inline constexpr const char* kAgentRelay = "TROUPE_AGENT_RELAY";
// The address this process binds and advertises (an agent's --host-addr / --iface);
// unset: 127.0.0.1.
inline constexpr const char* kHostAddr = "TROUPE_HOST_ADDR";
inline constexpr const char* kInsecure = "TROUPE_INSECURE";  // "1": the agent runs --insecure
// The node's snapshot keeper (a Unix socket path; checkpoint/snapshot_keeper.h).
inline constexpr const char* kSnapshotKeeper = "TROUPE_SNAPSHOT_KEEPER";

// ---- CURVE (docs/cluster.md "Security") ----
inline constexpr const char* kSchedulerPublicKey =
    "TROUPE_SCHEDULER_PUBLIC_KEY";                                     // set: the scheduler runs CURVE
inline constexpr const char* kCurveKey = "TROUPE_CURVE_KEY";           // the agent's key file (a path)
inline constexpr const char* kJobPublicKey = "TROUPE_JOB_PUBLIC_KEY";  // the job's own key pair: public half
// A 0600 file holding the job's secret key (written by the agent, removed when the
// process ends); the key itself is never in any environment.
inline constexpr const char* kJobSecretKeyFile = "TROUPE_JOB_SECRET_KEY_FILE";

}  // namespace troupe::job_env
