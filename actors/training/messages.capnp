# actors/training/messages.capnp — the wire schema of the training actors' messages
# (actors/training/messages.h has the plain C++ structs; only messages_codec.cc includes
# the generated header).
#
# Evolution rules (Cap'n Proto's, as scheduler/protocol.capnp): add fields only with the
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
