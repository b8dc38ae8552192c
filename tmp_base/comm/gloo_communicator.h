// comm/gloo_communicator.h — defines make_gloo_communicator(): the CPU backend of
// Communicator over Gloo's TCP transport (Debian libgloo, 2022 snapshot).
//
// How it runs: collectives execute one at a time, in issue order, on one worker thread per
// communicator (Gloo's collectives block); send/recv are posted at once on the caller's
// thread and completed by a second thread, so a pipeline's send and recv in both
// directions never wait on each other. Each collective gets its own Gloo tag (the issue
// sequence number), so a message of a failed operation can never match a later one.
//
// Numerics: bf16/f16 all_reduce converts to fp32, reduces in fp32 and converts back
// (rounded once, at the end). reduce_scatter is an all-to-all of the input's chunks in the
// input dtype (bf16 stays bf16 on the wire) followed by a local reduction in fp32 (f32,
// bf16, f16) or in the integer type, summing in rank order; it is deterministic.
//
// Signals: Gloo's sockets can raise SIGPIPE when a peer dies; the first communicator
// sets SIGPIPE to SIG_IGN if it still has its default action (which kills the process).
//
// Failure: every Gloo call carries the operation's timeout. A peer that dies is seen as a
// socket error at once; one that hangs as a timeout. The first failure (or abort) closes
// every connection of the communicator (peers blocked on us fail fast instead of timing
// out) and completes every pending Work.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/control/host_addr.h"

namespace troupe::comm {

struct GlooTransportOptions {
  std::string hostname =
      control::host_addr();  // address to bind and advertise ($TROUPE_HOST_ADDR or 127.0.0.1)
  std::string iface;         // if set, bind this interface instead (e.g. "eth0")
};

// Collective: every rank of `spec` calls it with the same name/namespace/size. Blocks
// until all ranks have connected or spec.options.init_timeout passes.
Result<std::unique_ptr<Communicator>> make_gloo_communicator(const CommSpec& spec,
                                                             const GlooTransportOptions& transport = {});

}  // namespace troupe::comm
