// tests/scheduler/test_worker.cc — the job program of the scheduler tests: behaves as its
// environment says, so tests can make a driver or worker run, heartbeat, rendezvous,
// hang or fail.
//
//   TW_RUN_MS        how long to run (default 0); TW_RUN_MS_E<k> overrides it in epoch k
//   TW_BEAT=1        heartbeat to the scheduler from the main loop (every TROUPE_HEARTBEAT_MS)
//   TW_EXIT          exit code at the end (default 0)
//   TW_OUT           directory for marker files "<name>.e<epoch>.r<driver restarts>.start/.done"
//   TW_CHILD=1       start a grandchild (/bin/sleep 600) in the process group, never waited for
//   TW_RENDEZVOUS=1  workers set "rank<r>" in the store and wait for every rank's key
//   TW_DRIVER_FOLLOW=1  the driver ends (early) once every worker of the job's current
//                    epoch has exited 0, as a supervising driver would
//   TW_ACTORS=1      workers run an actor system, report its address, and spawn an echo
//                    actor for each actor the driver places on them
//   TW_PLACE=1       the driver places actor "expert-<r>" on worker-r once every worker has
//                    an actor address, then asks each one through its actor system and
//                    writes "driver.placed" ("ok <n>" when all answered correctly)
// The .start marker holds the pid; the driver's also holds how many workers the
// scheduler reported running when it started (its re-attach check).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "actors/actor.h"
#include "actors/actor_system.h"
#include "scheduler/client/job_context.h"
#include "scheduler/client/scheduler_store.h"

using troupe::sched::JobContext;

namespace {

struct Echo {
  static constexpr uint64_t kTypeId = 0x0E5A'5C4E'0000'0001ULL;
  std::string text;
  void encode(troupe::control::ByteWriter& w) const { w.put_bytes(text); }
  static troupe::Result<Echo> decode(troupe::control::ByteReader& r) {
    Echo e;
    r.get_bytes(&e.text);
    TROUPE_RETURN_IF_ERROR(r.finish("Echo"));
    return e;
  }
};

class EchoActor final : public troupe::actors::Actor {
 public:
  EchoActor(std::string proc, int rank) {
    handle<Echo>([proc, rank](const Echo& e) {
      return Echo{fmt::format("{} rank {} pid {}: {}", proc, rank, getpid(), e.text)};
    });
  }
};

// Driver side of TW_PLACE: place, then reach every placed actor through its worker.
std::string place_and_ask(troupe::sched::SchedulerSession& session, const JobContext& ctx) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  uint64_t epoch = 0;
  std::vector<std::pair<std::string, std::string>> placements;
  while (std::chrono::steady_clock::now() < deadline) {
    session.beat();
    auto st = session.job_status(std::chrono::milliseconds(2000));
    if (st.ok()) {
      const auto& job = (*st)["jobs"][0];
      epoch = job.value("epoch", uint64_t{0});
      placements.clear();
      for (const auto& p : job["procs"]) {
        if (p.value("role", "") == "worker" && p.value("epoch", uint64_t{0}) == epoch && !p.value("endpoint", "").empty()) {
          placements.emplace_back(fmt::format("expert-{}", p.value("rank", 0)), p.value("name", ""));
        }
      }
      if (static_cast<int>(placements.size()) == ctx.world_size) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  auto placed = session.place_actors(epoch, placements, std::chrono::milliseconds(3000));
  if (!placed.ok()) return "place failed: " + placed.status().to_string();
  troupe::actors::ActorSystemOptions o;
  o.node_id = fmt::format("{}.driver.{}", ctx.job_id, getpid());
  o.threads = 1;
  o.network = troupe::sched::job_actor_network(o.node_id, /*bind=*/false);
  auto sys = troupe::actors::ActorSystem::create(std::move(o));
  if (!sys.ok()) return "actor system: " + sys.status().to_string();
  int ok = 0;
  for (const auto& a : (*placed)["actors"]) {
    std::string node = a.value("node", ""), actor = a.value("actor", "");
    if (!(*sys)->connect(node, a.value("endpoint", ""), troupe::sched::job_actor_server_key()).ok()) continue;
    while (std::chrono::steady_clock::now() < deadline) {
      auto r = (*sys)->ask<Echo>(troupe::actors::ActorRef(node, actor), Echo{"ping " + actor}, std::chrono::seconds(2)).get();
      if (r.ok()) {
        std::printf("driver: %s -> %s\n", actor.c_str(), r->text.c_str());
        if (r->text.find(a.value("proc", "") + " rank") == 0) ++ok;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // not spawned yet
    }
  }
  return fmt::format("ok {}", ok);
}

std::string env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

// Written whole, then renamed into place: a test that waits for the file to exist then
// reads it must never see it empty (seen once in CI: the read came between the create and
// the write).
void marker(const std::string& dir, const std::string& file, const std::string& text) {
  if (dir.empty()) return;
  const std::string path = dir + "/" + file, tmp = path + ".tmp";
  { std::ofstream(tmp) << text << "\n"; }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace

int main() {
  auto ctx_or = JobContext::from_env();
  if (!ctx_or.ok()) {
    std::fprintf(stderr, "test_worker: %s\n", ctx_or.status().to_string().c_str());
    return 2;
  }
  if (!ctx_or->has_value()) {
    std::printf("test_worker: not started by troupe\n");
    return 0;
  }
  JobContext ctx = **ctx_or;
  std::string tag = fmt::format("{}.e{}.r{}", ctx.name, ctx.epoch, ctx.driver_restarts);
  std::string out = env("TW_OUT");
  std::printf("test_worker %s: role=%s rank=%d world=%d epoch=%lu pid=%d\n", ctx.name.c_str(), ctx.role.c_str(),
              ctx.rank, ctx.world_size, static_cast<unsigned long>(ctx.epoch), getpid());
  std::fflush(stdout);

  if (env("TW_CHILD") == "1") {
    pid_t c = fork();
    if (c == 0) {
      execl("/bin/sleep", "sleep", "600", static_cast<char*>(nullptr));
      _exit(127);
    }
  }

  std::unique_ptr<troupe::sched::SchedulerSession> session;
  if (env("TW_BEAT") == "1" || ctx.is_driver()) {
    auto s = troupe::sched::SchedulerSession::connect(ctx);
    if (!s.ok()) {
      std::fprintf(stderr, "test_worker: %s\n", s.status().to_string().c_str());
      return 2;
    }
    session = std::move(s).value();
  }
  std::unique_ptr<troupe::actors::ActorSystem> actors;
  if (env("TW_ACTORS") == "1" && !ctx.is_driver() && session) {
    troupe::actors::ActorSystemOptions o;
    o.node_id = fmt::format("{}.{}.e{}.{}", ctx.job_id, ctx.name, ctx.epoch, getpid());
    o.threads = 1;
    // This host's address; the job's CURVE keys when the scheduler runs CURVE.
    o.network = troupe::sched::job_actor_network(o.node_id, /*bind=*/true);
    auto sys = troupe::actors::ActorSystem::create(std::move(o));
    if (!sys.ok()) {
      std::fprintf(stderr, "test_worker: %s\n", sys.status().to_string().c_str());
      return 2;
    }
    actors = std::move(sys).value();
    session->set_actor_address(actors->node_id(), actors->endpoint());
  }
  std::string start_text = std::to_string(getpid());
  if (ctx.is_driver() && session) {
    auto st = session->job_status(std::chrono::milliseconds(3000));
    int running = 0;
    if (st.ok()) {
      for (const auto& p : (*st)["jobs"][0]["procs"]) {
        if (p.value("role", "") == "worker" && p.value("state", "") == "running") ++running;
      }
    }
    start_text += fmt::format(" running_workers={}", running);
  }
  marker(out, tag + ".start", start_text);

  if (env("TW_RENDEZVOUS") == "1" && !ctx.is_driver()) {
    auto store = troupe::sched::SchedulerStore::connect(ctx);
    if (!store.ok()) return 3;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    if (!(*store)->set(fmt::format("rank{}", ctx.rank), std::to_string(getpid())).ok()) return 3;
    std::vector<std::string> keys;
    for (int r = 0; r < ctx.world_size; ++r) keys.push_back(fmt::format("rank{}", r));
    auto s = (*store)->wait(keys, deadline);
    if (!s.ok()) {
      std::fprintf(stderr, "test_worker: rendezvous: %s\n", s.to_string().c_str());
      return 3;
    }
    auto peer = (*store)->get(fmt::format("rank{}", (ctx.rank + 1) % ctx.world_size), deadline);
    std::printf("test_worker %s: rendezvous done, next rank's pid %s\n", ctx.name.c_str(),
                peer.ok() ? peer->c_str() : "?");
  }

  if (env("TW_PLACE") == "1" && ctx.is_driver() && session) marker(out, "driver.placed", place_and_ask(*session, ctx));

  int run_ms = std::atoi(env(fmt::format("TW_RUN_MS_E{}", ctx.epoch).c_str(), env("TW_RUN_MS", "0")).c_str());
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(run_ms);
  auto beat_every = std::chrono::milliseconds(std::max(20, ctx.heartbeat_ms));
  auto next_beat = std::chrono::steady_clock::now();
  bool follow = ctx.is_driver() && env("TW_DRIVER_FOLLOW") == "1";
  auto next_check = std::chrono::steady_clock::now();
  do {
    auto now = std::chrono::steady_clock::now();
    if (session && now >= next_beat) {
      session->beat();
      next_beat += beat_every;
    }
    if (actors && now >= next_check) {
      next_check = now + std::chrono::milliseconds(100);
      auto st = session->job_status(std::chrono::milliseconds(2000));
      if (st.ok()) {
        for (const auto& a : (*st)["jobs"][0].value("actors", nlohmann::json::array())) {
          std::string actor = a.value("actor", "");
          if (a.value("proc", "") == ctx.name && !actors->has_actor(actor)) {
            (void)actors->spawn<EchoActor>(actor, ctx.name, ctx.rank);
          }
        }
      }
    }
    if (follow && now >= next_check) {
      next_check = now + std::chrono::milliseconds(200);
      auto st = session->job_status(std::chrono::milliseconds(2000));
      if (st.ok()) {
        const auto& job = (*st)["jobs"][0];
        int done = 0;
        for (const auto& p : job["procs"]) {
          if (p.value("role", "") == "worker" && p.value("state", "") == "exited" && p.value("exit_status", 1) == 0 &&
              p.value("epoch", uint64_t{0}) == job.value("epoch", uint64_t{0})) {
            ++done;
          }
        }
        if (done == ctx.world_size) break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (std::chrono::steady_clock::now() < end);

  marker(out, tag + ".done", std::to_string(getpid()));
  std::printf("test_worker %s: done\n", ctx.name.c_str());
  return std::atoi(env("TW_EXIT", "0").c_str());
}
