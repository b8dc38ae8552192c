# scheduler/client/protocol.capnp — the wire schema between troupe-scheduler, troupe-agent,
# job processes (driver and workers) and the troupe CLI.
#
# Only scheduler/client/codec.cc includes the generated header; everything else sees the plain
# C++ structs of scheduler/client/protocol.h.
#
# Evolution rules (Cap'n Proto's): add fields and union members only with the next
# ordinal; never change an ordinal, a type or a default; a decoder rejects union members
# it does not know (a newer peer gets an error reply, never a crash). `version` in Msg
# is bumped when a change needs both sides to agree.
@0x9d85d4e69f1d816f;

struct KeyValue @0xc1d1a1e7a0b2f001 {
  key @0 :Text;
  value @1 :Text;
}

# One process of a job, as an agent sees it.
struct ProcStatus @0xc1d1a1e7a0b2f002 {
  jobId @0 :Text;
  name @1 :Text;          # "driver" or "worker-<rank>"
  epoch @2 :UInt64;       # the job epoch it was spawned for
  pid @3 :Int32;
  running @4 :Bool;
  exitCode @5 :Int32;     # valid when not running and termSignal == 0
  termSignal @6 :Int32;   # the signal that ended it, 0 when it exited
  error @7 :Text;         # a spawn failure ("exec: No such file or directory")
  timeMs @8 :Int64;       # wall clock (ms since epoch) of the start or the exit
}

struct SpawnRequest @0xc1d1a1e7a0b2f003 {
  jobId @0 :Text;
  name @1 :Text;
  epoch @2 :UInt64;
  argv @3 :List(Text);
  env @4 :List(KeyValue);
  workDir @5 :Text;       # empty: the agent's working directory
  jobSecretKey @6 :Text;  # CURVE: the job's secret key; the agent hands it to the process as a 0600 file
}

struct KillRequest @0xc1d1a1e7a0b2f004 {
  jobId @0 :Text;
  name @1 :Text;          # empty: every process of the job
  signal @2 :Int32;       # first signal; SIGKILL follows after graceMs
  graceMs @3 :Int32;
}

struct RegisterAgent @0xc1d1a1e7a0b2f005 {
  agentId @0 :Text;
  host @1 :Text;
  slots @2 :Int32;
  gpus @3 :Int32;
  procs @4 :List(ProcStatus);   # running processes and exits not yet acknowledged
}

struct RegisterAck @0xc1d1a1e7a0b2f006 {
  incarnation @0 :UInt64;       # changes each time the scheduler starts
  heartbeatMs @1 :Int32;
}

struct AgentHeartbeat @0xc1d1a1e7a0b2f007 {
  agentId @0 :Text;
  incarnation @1 :UInt64;       # the scheduler incarnation the agent registered with
  sentAtMs @2 :Int64;           # the agent's wall clock when sent (ms since the epoch; 0: unknown)
  snapshotBytes @3 :UInt64;     # its snapshot keeper: segment bytes held
  snapshotParts @4 :Int32;      #   landed parts of its workers
  snapshotCopies @5 :Int32;     #   copies of other nodes' parts
}

# A job process telling the scheduler it is alive (hello on connect, then beats).
struct ProcBeat @0xc1d1a1e7a0b2f008 {
  jobId @0 :Text;
  name @1 :Text;
  epoch @2 :UInt64;
  pid @3 :Int32;
  hello @4 :Bool;
  actorNode @5 :Text;     # the node id of the process's own actor system, if it runs one
  endpoint @6 :Text;      # where that actor system listens
  sentAtMs @7 :Int64;     # the process's wall clock when sent (ms since the epoch; 0: unknown)
}

enum StoreOp @0xc1d1a1e7a0b2f009 {
  set @0;
  get @1;
  wait @2;
  contains @3;
}

struct StoreRequest @0xc1d1a1e7a0b2f00a {
  op @0 :StoreOp;
  jobId @1 :Text;
  epoch @2 :UInt64;
  keys @3 :List(Text);
  value @4 :Data;
  timeoutMs @5 :Int32;
}

struct ExitAck @0xc1d1a1e7a0b2f00b {
  jobId @0 :Text;
  name @1 :Text;
  epoch @2 :UInt64;
  pid @3 :Int32;
}

struct LogsRequest @0xc1d1a1e7a0b2f00c {
  jobId @0 :Text;
  name @1 :Text;
  offset @2 :Int64;
  maxBytes @3 :Int32;
}

# Every request from a client gets exactly one Reply with the same requestId.
struct Reply @0xc1d1a1e7a0b2f00d {
  code @0 :UInt8;         # troupe::StatusCode; 0 = OK
  message @1 :Text;
  body @2 :Text;          # JSON document (job spec, status), when the request has one
  data @3 :Data;          # raw bytes (store values, log chunks)
  offset @4 :Int64;       # for logs: the offset after this chunk
}

# The driver's placement of the job's actors on its processes, for one epoch.
struct ActorPlacement @0xc1d1a1e7a0b2f00f {
  actor @0 :Text;         # actor name, unique in the job
  proc @1 :Text;          # "worker-<rank>" or "driver"
}

struct PlaceActors @0xc1d1a1e7a0b2f010 {
  jobId @0 :Text;
  epoch @1 :UInt64;
  placements @2 :List(ActorPlacement);
  layout @3 :Text;  # the layout the driver runs ("pp=2,dp=2,n=1"); empty: not said
}

# One message of a session relayed by a node's agent: the job processes of a host talk to
# their local agent (an ipc:// endpoint, no CURVE), which carries their sessions over its
# own scheduler connection, so the scheduler holds one CURVE connection per host
# (docs/architecture.md, "Worker sessions through the agent").
# agent -> scheduler: `msg` came from the agent's local session `session`;
# scheduler -> agent: deliver `msg` to that session. `msg` is one encoded Msg, never a relay.
struct Relay @0xc1d1a1e7a0b2f011 {
  session @0 :Text;       # the agent's name for the session ("<node>/inbox", "ask:<n>")
  msg @1 :Data;
}

# One named reading of a worker's health report (observe/metric.h lists the names).
struct HealthMetric @0xc1d1a1e7a0b2f012 {
  name @0 :Text;
  value @1 :Float64;
}

# A job process's machine health, sent every second by its reporter
# (scheduler/client/health_reporter.h): host and process counters from /proc, GPU readings from
# NVML, the last steps' timings. It is not a heartbeat (it starts no monitoring), but the
# detector holds a worker whose reports stop against it.
struct HealthReport @0xc1d1a1e7a0b2f013 {
  jobId @0 :Text;
  name @1 :Text;
  epoch @2 :UInt64;
  pid @3 :Int32;
  sentAtMs @4 :Int64;
  metrics @5 :List(HealthMetric);
}

struct Msg @0xc1d1a1e7a0b2f00e {
  version @0 :UInt16;
  requestId @1 :UInt64;
  union {
    registerAgent @2 :RegisterAgent;
    registerAck @3 :RegisterAck;
    agentHeartbeat @4 :AgentHeartbeat;
    reregister @5 :Void;             # scheduler -> agent: "I do not know you, register"
    spawn @6 :SpawnRequest;
    kill @7 :KillRequest;
    procStarted @8 :ProcStatus;
    procExited @9 :ProcStatus;
    exitAck @10 :ExitAck;
    procBeat @11 :ProcBeat;
    store @12 :StoreRequest;
    submit @13 :Text;                # JobSpec as JSON
    status @14 :Text;                # job id, empty for every job, "-" for none (agents, scheduler figures)
    cancel @15 :Text;                # job id
    logs @16 :LogsRequest;
    reply @17 :Reply;
    logsForAgent @18 :LogsRequest;   # scheduler -> agent, requestId maps back to the CLI
    placeActors @19 :PlaceActors;    # driver -> scheduler; the reply body lists addresses
    relay @20 :Relay;                # agent <-> scheduler: a local session's message
    health @21 :HealthReport;        # job process -> scheduler, every second
  }
}
