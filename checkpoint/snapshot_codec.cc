// checkpoint/snapshot_codec.cc — the Cap'n Proto codec of checkpoint/snapshot_protocol.h: one
// field table per message (core/capnp_fields.h copies both ways by it). Compiled as C++17:
// Cap'n Proto 0.9.2 headers fail under GCC 13 in C++20 mode.

#include "checkpoint/snapshot.capnp.h"
#include "checkpoint/snapshot_protocol.h"
#include "core/capnp_fields.h"

namespace troupe::checkpoint {
namespace {

namespace cc = capnp_codec;

constexpr CapnpLimits kLimits{size_t{4} << 20,
                              uint64_t{1} << 20};  // a query of many parts is a few hundred KB

// Field order is the order the encoder fills the message in: keep it, and the bytes stay
// those of earlier builds.
using cc::alt;

// A rank's part of a job's snapshot of a step, as most requests and SnapHeld name it.
constexpr auto kPart =
    cc::fields(TROUPE_CAPNP_FIELD(job, Job), TROUPE_CAPNP_FIELD(rank, Rank), TROUPE_CAPNP_FIELD(step, Step));
// SnapBegin and SnapLanded: a rank's generation of the snapshot of a step.
constexpr auto kGeneration = cc::fields(TROUPE_CAPNP_FIELD(job, Job), TROUPE_CAPNP_FIELD(rank, Rank),
                                        TROUPE_CAPNP_FIELD(gen, Gen), TROUPE_CAPNP_FIELD(step, Step));

// SnapRequest is one union: each request kind is a group of it.
constexpr auto kRequest =
    cc::one_of(alt<SnapAttach>(TROUPE_CAPNP_WHOLE(
                   Attach, cc::fields(TROUPE_CAPNP_FIELD(job, Job), TROUPE_CAPNP_FIELD(rank, Rank),
                                      TROUPE_CAPNP_FIELD(bytes, Bytes)))),
               alt<SnapBegin>(TROUPE_CAPNP_WHOLE(Begin, kGeneration)),
               alt<SnapLanded>(TROUPE_CAPNP_WHOLE(Landed, kGeneration)),
               alt<SnapCommit>(TROUPE_CAPNP_WHOLE(
                   Commit, cc::join(kPart, cc::fields(TROUPE_CAPNP_FIELD(replicate_to, ReplicateTo))))),
               alt<SnapFetch>(TROUPE_CAPNP_WHOLE(
                   Fetch, cc::join(kPart, cc::fields(TROUPE_CAPNP_FIELD(sources, Sources))))),
               alt<SnapQuery>(TROUPE_CAPNP_WHOLE(Query, cc::fields(TROUPE_CAPNP_FIELD(job, Job)))),
               alt<SnapRelease>(TROUPE_CAPNP_WHOLE(
                   Release, cc::fields(TROUPE_CAPNP_FIELD(job, Job), TROUPE_CAPNP_FIELD(rank, Rank)))),
               alt<SnapPut>(TROUPE_CAPNP_WHOLE(
                   Put, cc::join(kPart, cc::fields(TROUPE_CAPNP_FIELD(bytes, Bytes),
                                                   TROUPE_CAPNP_FIELD(from_node, FromNode))))),
               alt<SnapGet>(TROUPE_CAPNP_WHOLE(Get, kPart)));

constexpr auto kGen = cc::fields(TROUPE_CAPNP_FIELD(step, Step), TROUPE_CAPNP_FIELD(state, State));
constexpr auto kHeld = cc::join(
    kPart, cc::fields(TROUPE_CAPNP_FIELD(bytes, Bytes), TROUPE_CAPNP_FIELD(replica, Replica),
                      TROUPE_CAPNP_FIELD(from_node, FromNode), TROUPE_CAPNP_FIELD(committed, Committed),
                      TROUPE_CAPNP_FIELD(replicated_to, ReplicatedTo),
                      TROUPE_CAPNP_FIELD(replicated_step, ReplicatedStep)));
constexpr auto kReply =
    cc::fields(TROUPE_CAPNP_FIELD(code, Code), TROUPE_CAPNP_FIELD(text, Text), TROUPE_CAPNP_FIELD(node, Node),
               TROUPE_CAPNP_FIELD(endpoint, Endpoint), TROUPE_CAPNP_LIST(gens, Gens, kGen),
               TROUPE_CAPNP_LIST(held, Held, kHeld), TROUPE_CAPNP_FIELD(bytes, Bytes));

}  // namespace

TROUPE_CAPNP_CODEC(snap_request, SnapRequest, kRequest, kLimits, cc::kNoCheck)
TROUPE_CAPNP_CODEC(snap_reply, SnapReply, kReply, kLimits, cc::kNoCheck)

}  // namespace troupe::checkpoint
