# checkpoint/snapshot.capnp — the wire schema of the snapshot keeper's two protocols
# (checkpoint/snapshot_protocol.h has the plain C++ structs; only snapshot_codec.cc includes
# the generated header):
#   a worker and the keeper of its node (a Unix seqpacket socket in the keeper's 0700
#   directory; each datagram is one message, segment descriptors ride along as SCM_RIGHTS);
#   two keepers (TCP; a length-prefixed message, then for put and a get's reply the raw
#   bytes of one snapshot segment).
#
# Evolution rules (Cap'n Proto's): add fields only with the next ordinal; never change an
# ordinal, a type or a default. Tensors never travel in these structs.
@0xd5a3c0e81f2b4a70;

# A worker takes the two generation segments of (job, rank) (created, or resized when a
# new layout needs more bytes). The reply carries their descriptors.
struct SnapAttach @0xd5a3c0e81f2b4a71 {
  job @0 :Text;
  rank @1 :Int32;
  bytes @2 :UInt64;        # the segment size the worker needs
}

# The worker is about to write generation `gen` (a push of what it held is cancelled).
struct SnapBegin @0xd5a3c0e81f2b4a72 {
  job @0 :Text;
  rank @1 :Int32;
  gen @2 :UInt32;
  step @3 :Int64;
}

# Generation `gen` holds the complete part of `step` (its header says so).
struct SnapLanded @0xd5a3c0e81f2b4a73 {
  job @0 :Text;
  rank @1 :Int32;
  gen @2 :UInt32;
  step @3 :Int64;
}

# Every rank's part of `step` landed (the driver committed the snapshot): older parts of
# (job, rank) may go, and the part is copied to the keeper at `replicateTo` ("": none).
struct SnapCommit @0xd5a3c0e81f2b4a74 {
  job @0 :Text;
  rank @1 :Int32;
  step @2 :Int64;
  replicateTo @3 :Text;
}

# The part of (job, rank) after `step`: from this keeper's memory, else from the first of
# `sources` (other keepers' endpoints) that holds it. The reply carries one descriptor.
struct SnapFetch @0xd5a3c0e81f2b4a75 {
  job @0 :Text;
  rank @1 :Int32;
  step @2 :Int64;
  sources @3 :List(Text);
}

# What this keeper holds of `job` ("": of every job).
struct SnapQuery @0xd5a3c0e81f2b4a76 {
  job @0 :Text;
}

# Drops every part of (job, rank) (rank -1: of the whole job), here and at its replica.
struct SnapRelease @0xd5a3c0e81f2b4a77 {
  job @0 :Text;
  rank @1 :Int32;
}

# Keeper to keeper: a copy of a segment follows (`bytes` raw bytes).
struct SnapPut @0xd5a3c0e81f2b4a78 {
  job @0 :Text;
  rank @1 :Int32;
  step @2 :Int64;
  bytes @3 :UInt64;
  fromNode @4 :Text;
}

# Keeper to keeper: send the segment of (job, rank, step) back (the reply's `bytes` raw
# bytes follow it).
struct SnapGet @0xd5a3c0e81f2b4a79 {
  job @0 :Text;
  rank @1 :Int32;
  step @2 :Int64;
}

struct SnapRequest @0xd5a3c0e81f2b4a7a {
  union {
    attach @0 :SnapAttach;
    begin @1 :SnapBegin;
    landed @2 :SnapLanded;
    commit @3 :SnapCommit;
    fetch @4 :SnapFetch;
    query @5 :SnapQuery;
    release @6 :SnapRelease;
    put @7 :SnapPut;
    get @8 :SnapGet;
  }
}

struct SnapGen @0xd5a3c0e81f2b4a7b {
  step @0 :Int64;          # -1: empty
  state @1 :UInt32;        # SegmentState
}

# One part a keeper holds.
struct SnapHeld @0xd5a3c0e81f2b4a7c {
  job @0 :Text;
  rank @1 :Int32;
  step @2 :Int64;
  bytes @3 :UInt64;
  replica @4 :Bool;            # a copy received from another keeper
  fromNode @5 :Text;           # replica: the keeper it came from
  committed @6 :Bool;
  replicatedTo @7 :Text;       # local part: the keeper its copy went to
  replicatedStep @8 :Int64 = -1;  # and the newest step that landed there
}

struct SnapReply @0xd5a3c0e81f2b4a7d {
  code @0 :UInt16;         # troupe::StatusCode (0: ok)
  text @1 :Text;
  node @2 :Text;           # the keeper's node and TCP endpoint (attach, fetch)
  endpoint @3 :Text;
  gens @4 :List(SnapGen);  # attach: what the two generations hold
  held @5 :List(SnapHeld); # query
  bytes @6 :UInt64;        # fetch / get: the segment's size
}
