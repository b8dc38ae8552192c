# comm/control/schema/envelope.capnp — the control-plane wire format: one Envelope per
# ZeroMQ frame. System payloads (heartbeat, supervision, errors) are defined here; every
# other layer (scheduler, training) carries its own messages in `user` as
# {typeId, data} and defines their encoding in its own files, without editing this one.
#
# Evolution rules (docs/control-plane.md): add fields, enumerants and union members only
# with the next ordinal; never change an ordinal, a type, a default or a type id; every
# type carries an explicit @0x id. A breaking change bumps kProtocolVersion instead.
@0xa6fae0f4fc35db2a;

$import "/capnp/c++.capnp".namespace("troupe::control::wire");

# "node/name": the process (node) an actor lives in and the actor's name in it.
struct ActorAddress @0xaaec61b471f76259 {
  node @0 :Text;
  name @1 :Text;
}

enum DownReason @0xb78cfa8bb0f7c38f {
  exit @0;              # the actor stopped normally
  crash @1;             # a handler threw or on_start failed
  heartbeatTimeout @2;  # its process stopped answering application heartbeats
  connectionLost @3;    # the connection to its process closed
  killed @4;            # stopped by the system (shutdown, linked actor failed)
}

struct Heartbeat @0xe882aeabf4d23fa9 {
  sequence @0 :UInt64;
  sentAtNanos @1 :Int64;   # sender's wall clock, for logs only
}

# Asks the receiver's node to send a Down for `target` to `watcher` when it stops.
struct MonitorRequest @0xcc354f31069bba82 {
  watcher @0 :ActorAddress;
  target @1 :ActorAddress;
}

# A link is a monitor in both directions whose abnormal Down also stops the other side.
struct LinkRequest @0xa34fa0ac3713fd0b {
  from @0 :ActorAddress;
  to @1 :ActorAddress;
}

struct UnlinkRequest @0xaa848a60ce39e184 {
  from @0 :ActorAddress;
  to @1 :ActorAddress;
}

struct Down @0xcdd9190503b60bd3 {
  actor @0 :ActorAddress;   # the actor that stopped (or is presumed stopped)
  reason @1 :DownReason;
  text @2 :Text;            # a reason a person can read
}

# The reply to an ask that failed: a troupe::StatusCode value and its message.
struct ErrorReply @0xbdec45eb67220a5c {
  code @0 :UInt16;
  message @1 :Text;
}

# A payload whose type and encoding belong to another layer.
struct UserPayload @0x8022e61cf032a46e {
  typeId @0 :UInt64;        # chosen by that layer; 0 is invalid
  data @1 :Data;
}

struct Envelope @0xa026424a9bce8188 {
  protocolVersion @0 :UInt16;
  sender @1 :ActorAddress;      # empty name: sent from outside any actor
  receiver @2 :ActorAddress;    # empty name: addressed to the node itself
  correlationId @3 :UInt64;     # non-zero for an ask and for its reply
  isReply @4 :Bool;             # true on the reply to an ask
  deadlineUnixNanos @5 :Int64;  # 0: none; past it the receiver drops the request
  messageTypeId @6 :UInt64;     # the user payload's typeId, or the system payload's id
  payload :union {
    heartbeat @7 :Heartbeat;
    monitor @8 :MonitorRequest;
    demonitor @9 :MonitorRequest;
    link @10 :LinkRequest;
    unlink @11 :UnlinkRequest;
    down @12 :Down;
    error @13 :ErrorReply;
    ack @14 :Void;
    user @15 :UserPayload;
  }
}
