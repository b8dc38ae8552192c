# training/messages.capnp — the wire schema of the training actors' messages
# (training/messages.h has the plain C++ structs; only messages_codec.cc includes
# the generated header).
#
# Evolution rules (Cap'n Proto's, as scheduler/client/protocol.capnp): add fields only with the
# next ordinal; never change an ordinal, a type or a default. Tensors never travel here.
@0xb7e4a2c91d3f5a60;

# Asks a training actor (stage, attention shard, expert group) for its status.
struct ActorStatusQuery @0xb7e4a2c91d3f5a61 {
  requester @0 :Text;     # who asks (for the actor's log), may be empty
}

# A training actor's status: what `troupe status --actors` prints.
struct ActorStatus @0xb7e4a2c91d3f5a62 {
  id @0 :Text;            # "stage.3", "attention.3", "experts.3"
  role @1 :Text;          # "stage", "attention", "experts"
  rank @2 :Int32;         # world rank of its worker in the current epoch
  slot @3 :Int32;         # the worker process (stable across epochs)
  epoch @4 :UInt64;       # membership epoch
  state @5 :Text;         # "joining", "ready", "training", "recovering"
  stepsDone @6 :Int64;    # optimizer steps of the state it owns
  lastStepMs @7 :Float64; # wall time of its worker's last step (0: none yet)
  params @8 :Int64;       # parameters it owns on this rank
  device @9 :Text;        # "cpu" or "cuda:<visible device>"
  host @10 :Text;         # host name of its worker
  pid @11 :Int32;
}

# The Trainer's command to every stage actor of the epoch (training/control.h).
struct StepCommand @0xb7e4a2c91d3f5a63 {
  seq @0 :Int64;          # 0, 1, 2, ... across epochs, in the order the Trainer sends them
  kind @1 :UInt8;         # Command::Kind: 0 step, 1 evaluate, 2 stop, 3 save, 4 snapshot
  step @2 :Int64;         # step: the 1-based optimizer step to run; save: the step just run
  epoch @3 :UInt64;       # the membership epoch it belongs to
}

struct NamedValue @0xb7e4a2c91d3f5a64 {
  name @0 :Text;
  value @1 :Float64;
}

struct LoadRow @0xb7e4a2c91d3f5a65 {
  counts @0 :List(Int64);  # tokens routed to each expert of one MoE block
}

struct CheckpointError @0xb7e4a2c91d3f5a66 {
  step @0 :Int64;
  text @1 :Text;
}

# A worker's reply to one command (rank 0's carries the step's metrics for the whole job).
struct StepReply @0xb7e4a2c91d3f5a67 {
  seq @0 :Int64;
  epoch @1 :UInt64;
  rank @2 :Int32;
  slot @3 :Int32;
  kind @4 :UInt8;
  # kind step:
  step @5 :Int64;
  loss @6 :Float64;
  lmLoss @7 :Float64;
  auxLoss @8 :Float64;
  gradNorm @9 :Float64;
  lr @10 :Float64;
  stepTokens @11 :Int64;
  expertLoad @12 :List(LoadRow);
  stepMs @13 :Float64;
  commMs @14 :Float64;
  computeMs @15 :Float64;
  commMsMean @16 :Float64;
  commByKindMs @17 :List(NamedValue);
  peakBytes @18 :Int64 = -1;
  # kind evaluate:
  valLoss @19 :Float64;
  # checkpoints (written from a committed snapshot; -1: none):
  ckptStarted @20 :Int64 = -1;
  ckptBlockedMs @21 :Float64;
  ckptBytes @22 :Int64;
  durable @23 :List(Int64);
  ckptErrors @24 :List(CheckpointError);
  # retired (neighbour replicas and the in-memory commit, replaced by snapshots): never
  # written; the ordinals stay taken so an old peer's message cannot be misread
  retiredReplica @25 :Int64 = -1;
  retiredReplicaMs @26 :Float64;
  retiredCommitMs @27 :Float64 = -1;
  # device runs: the rank's device->host reads in the step (-1: CPU)
  hostSyncs @28 :Int64 = -1;
  # device runs (-1: CPU): uploads that waited, activation bytes, the step's device time
  # and the device's idle time before its first op (since the previous step's last)
  uploadWaits @29 :Int64 = -1;
  activationBytes @30 :Int64 = -1;
  deviceMs @31 :Float64 = -1;
  deviceGapMs @32 :Float64 = -1;
  # the worker's command queue: the step was launched before the previous one finished;
  # the next command was already queued when this reply was sent; how long the worker
  # waited for this command after serving the one before (ms)
  launchedAhead @33 :Bool;
  nextQueued @34 :Bool;
  commandWaitMs @35 :Float64;
  # the rank's process: its peak resident host memory so far (-1: unknown)
  rssPeakBytes @36 :Int64 = -1;
  # snapshots: the step whose snapshot this rank started after the command (-1: none),
  # the step thread's time to start it, and its wait for a free generation (-1: none)
  snapshot @37 :Int64 = -1;
  snapshotMs @38 :Float64;
  snapshotWaitMs @39 :Float64 = -1;
  # the newest step of this rank's snapshots whose copy landed on another node's keeper
  snapshotReplicated @40 :Int64 = -1;
  snapshotErrors @41 :List(CheckpointError);
}

# A worker's failure in an epoch (a data-plane error, a failed join), reported to the
# Trainer: a typed value, not a string in a store key.
struct WorkerFailure @0xb7e4a2c91d3f5a68 {
  epoch @0 :UInt64;
  slot @1 :Int32;
  rank @2 :Int32;
  code @3 :UInt16;        # troupe::StatusCode
  actor @4 :Text;         # the actor that failed ("stage.2")
  text @5 :Text;
  tsMs @6 :Int64;         # wall clock of the failure (ms since the epoch)
  snapshotStep @7 :Int64 = -1;  # a restore of this snapshot failed (its part is lost or damaged)
}

# The plan of a membership epoch (rebuild), sent by the Trainer to the stage actor of every
# worker of the old epoch when it opens the new one (also recorded in the job's store).
struct ElasticPlan @0xb7e4a2c91d3f5a69 {
  epoch @0 :UInt64;
  dp @1 :Int64;             # the layout's dp in the new epoch
  gradAccum @2 :Int64;      # and the matching micro-batches per step
  slots @3 :List(Int32);    # the worker slot of each world rank
  hasState @4 :List(Bool);  # per rank: a survivor that keeps its live state (plans that restore nothing)
  stepDone @5 :Int64;       # every rank restores the state after this step
  seq @6 :Int64;            # the first command seq of the epoch
  reason @7 :Text;
  checkpoint @8 :Text;      # non-empty: restore from this checkpoint directory
  ckptEvery @9 :Int64;      # the job's periodic checkpoints
  ckptDir @10 :Text;
  retiredReplicaStep @11 :Int64 = -1;  # retired (neighbour replicas): never written
  retiredReplicaEvery @12 :Int64;
  snapshotStep @13 :Int64 = -1;  # >= 0: every rank restores the snapshot of this step
  snapshotEvery @14 :Int64;       # snapshots after every this many steps (0: none)
  snapshotDp @15 :Int64;          # the snapshot's layout dp (its parts' layout)
  snapshotParts @16 :List(PartSource);  # per rank of the snapshot's layout
  snapshotCommitted @17 :Int64 = -1;    # the newest committed snapshot (a rank keeps it)
}

# Where a snapshot's part can be fetched from, and what it is.
struct PartSource @0xb7e4a2c91d3f5a6c {
  endpoints @0 :List(Text);  # keepers holding it (its node's, then its copy's)
  xxh64 @1 :UInt64;          # the checksum of its manifest (which checksums every slice)
}

# A rank's snapshot part landed in its node's keeper (worker -> trainer, as soon as it did).
struct SnapshotLanded @0xb7e4a2c91d3f5a6a {
  epoch @0 :UInt64;
  rank @1 :Int32;
  slot @2 :Int32;
  step @3 :Int64;
  xxh64 @4 :UInt64;        # of the part's manifest
  bytes @5 :UInt64;        # its segment
  node @6 :Text;           # the keeper holding it
  endpoint @7 :Text;       # that keeper's endpoint for other keepers ("": none)
  error @8 :Text;          # non-empty: the part could not be made
}

# Every rank's part of `step` landed: the snapshot is committed (trainer -> every stage actor).
struct SnapshotCommitted @0xb7e4a2c91d3f5a6b {
  epoch @0 :UInt64;
  step @1 :Int64;
  copyTo @2 :List(NodeTarget);  # per node: the keeper that keeps its copy
  checkpoint @3 :Bool;          # also written to disk as a checkpoint
  abandoned @4 :Bool;           # instead: `step` never commits (a part failed): its memory is free
}

struct NodeTarget @0xb7e4a2c91d3f5a6d {
  node @0 :Text;
  endpoint @1 :Text;
}
