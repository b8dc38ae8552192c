// tests/apps/train_moe_cli_test.cc — the train_moe binary end to end, as a user runs it
// (real processes, real files): prepare -> train (the Trainer and its worker in one
// process) -> sample (from the run's final checkpoint) -> plot on a small corpus; the
// commands kept in flight and the worker isolated in a child; and the errors for missing
// inputs, a missing data directory, a bad config key or value, a layout that does not fit
// the model, and what one process cannot do.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/exit_status.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;

struct CliResult {
  int code = -1;
  std::string out;  // stdout and stderr together
};

// Runs train_moe with args (stdout+stderr to a file), killing it after timeout_s.
CliResult train_moe(const std::vector<std::string>& args, int timeout_s = 120) {
  static int counter = 0;
  const std::string log = ::testing::TempDir() + "/cli_" + std::to_string(getpid()) + "_" + std::to_string(counter++);
  std::vector<std::string> all = {TRAIN_MOE_BIN};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  CliResult r;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.out = "timed out";
      return r;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::stringstream ss;
  ss << std::ifstream(log).rdbuf();
  r.out = ss.str();
  fs::remove(log);
  return r;
}

std::string fmt_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), " %.2f", ms);
  return buf;
}

std::string temp_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/train_moe_cli_" + std::to_string(getpid()) + "_" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A small corpus of varied text files.
std::string make_corpus(const std::string& dir) {
  fs::create_directories(dir + "/corpus/sub");
  const char* words[] = {"alpha", "beta", "gamma", "delta", "value", "return", "self", "import", "class", "def"};
  for (int f = 0; f < 12; ++f) {
    std::ofstream o(dir + "/corpus/" + (f % 2 ? "sub/" : "") + "file" + std::to_string(f) + ".py");
    for (int line = 0; line < 150; ++line) {
      o << "def " << words[(line + f) % 10] << "_" << line % 7 << "(x):\n    return x + " << words[line % 10] << " * "
        << (line * f) % 13 << "\n";
    }
  }
  std::ofstream(dir + "/corpus/ignored.bin") << "not a text extension";
  return dir + "/corpus";
}

std::string write_config(const std::string& dir, const std::string& data_dir, const std::string& extra = "") {
  const std::string path = dir + "/tiny_test.toml";
  std::ofstream(path)
      << "[model]\nvocab_size = 320\nd_model = 32\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n"
         "ffn_hidden = 48\nmoe_every = 2\nmoe_first = 1\n"
         "[model.moe]\nnum_experts = 4\ntop_k = 2\nexpert_hidden = 16\n"
         "[train]\nsteps = 4\nseq_len = 16\nglobal_batch = 4\nmicro_batch_size = 2\neval_every = 2\n"
         "eval_batches = 2\n[optim]\nlr = 1e-3\nwarmup_steps = 1\n[data]\ndir = \""
      << data_dir << "\"\n"
      << extra;
  return path;
}

TEST(TrainMoeCli, PrepareTrainSamplePlot) {
  const std::string dir = temp_dir("e2e");
  const std::string corpus = make_corpus(dir);
  CliResult p = train_moe({"prepare", "--input", corpus, "--out", dir + "/data", "--vocab", "320", "--val-fraction", "0.2"});
  ASSERT_EQ(p.code, 0) << p.out;
  EXPECT_NE(p.out.find("tokenizer: "), std::string::npos) << p.out;
  EXPECT_NE(p.out.find("12 documents"), std::string::npos) << p.out;  // ignored.bin is not taken
  for (const char* f : {"tokenizer.json", "train-00000.bin", "val-00000.bin", "meta.json"}) {
    EXPECT_TRUE(fs::exists(dir + "/data/" + f)) << f;
  }

  const std::string cfg = write_config(dir, dir + "/data");
  CliResult t = train_moe({"--config", cfg, "--run-dir", dir + "/run", "--set", "train.steps=4"});
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_NE(t.out.find("step 4/4"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("tok/s"), std::string::npos);
  std::ifstream mf(dir + "/run/metrics.jsonl");
  std::string line;
  int steps = 0, vals = 0;
  while (std::getline(mf, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) ++vals;
    if (!j.contains("loss")) continue;
    ++steps;
    for (const char* k : {"step", "loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms",
                          "expert_load"}) {
      EXPECT_TRUE(j.contains(k)) << k << " missing in " << line;
    }
    ASSERT_EQ(j["expert_load"].size(), 1u);  // one MoE block
    int64_t load = 0;
    for (auto& v : j["expert_load"][0]) load += v.get<int64_t>();
    EXPECT_EQ(load, 2 * 2 * 16 * 2);  // micro-batches x rows x seq x top_k
    EXPECT_EQ(j["tokens"].get<int64_t>(), steps * 64);
  }
  EXPECT_EQ(steps, 4);
  EXPECT_EQ(vals, 3);  // step 0, 2 and 4
  // The final weights: a checkpoint of the last step (what sample reads below).
  EXPECT_TRUE(fs::exists(dir + "/run/checkpoints/step_4/manifest.json"));
  EXPECT_TRUE(fs::exists(dir + "/run/tokenizer.json"));
  // One process: the worker was a thread of this process (no child, no rendezvous files).
  {
    std::ifstream ev(dir + "/run/events.jsonl");
    bool in_process = false;
    while (std::getline(ev, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.value("event", "") == "worker_started") in_process = j.value("in_process", false);
    }
    EXPECT_TRUE(in_process);
    EXPECT_FALSE(fs::exists(dir + "/run/rendezvous"));
  }

  // The time limit stops a run early, after the steps in flight (train.steps_in_flight = 2:
  // step 2 was sent before step 1 ended), with validation and the final checkpoint.
  CliResult tl = train_moe({"--config", cfg, "--run-dir", dir + "/run_tl", "--set", "train.steps=500", "--set",
                            "train.time_limit_s=0.001"});
  ASSERT_EQ(tl.code, 0) << tl.out;
  EXPECT_NE(tl.out.find("time limit of"), std::string::npos) << tl.out;
  EXPECT_NE(tl.out.find("step 2/500"), std::string::npos) << tl.out;
  EXPECT_EQ(tl.out.find("step 3/500"), std::string::npos) << tl.out;
  EXPECT_NE(tl.out.find("val_loss"), std::string::npos) << tl.out;
  EXPECT_TRUE(fs::exists(dir + "/run_tl/checkpoints/step_2/manifest.json"));

  // bf16 expert gradients: the Stage applies them on the CPU too (f32 sums of bf16 products).
  CliResult bf = train_moe({"--config", cfg, "--run-dir", dir + "/run_bf16", "--set", "train.steps=1",
                            "--set", "train.global_batch=2", "--set", "train.expert_grads=bf16"});
  ASSERT_EQ(bf.code, 0) << bf.out;
  EXPECT_EQ(bf.out.find("is not applied"), std::string::npos) << bf.out;
  EXPECT_NE(bf.out.find("step 1/1"), std::string::npos) << bf.out;

  CliResult s = train_moe({"sample", "--run", dir + "/run", "--prompt", "def alpha", "--tokens", "20", "--seed", "3"});
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_EQ(s.out.rfind("def alpha", 0), 0u) << s.out;
  EXPECT_NE(s.out.find("[sample: "), std::string::npos);
  CliResult s2 = train_moe({"sample", "--run", dir + "/run", "--prompt", "def alpha", "--tokens", "20", "--seed", "3"});
  EXPECT_EQ(s.out, s2.out);  // seeded sampling is reproducible

  CliResult pl = train_moe({"plot", "--run", dir + "/run"}, 180);
  ASSERT_EQ(pl.code, 0) << pl.out;
  for (const char* f : {"loss.png", "throughput.png", "expert_load.png"}) EXPECT_TRUE(fs::exists(dir + "/run/" + f)) << f;
  if (!HasFailure()) fs::remove_all(dir);
}

// Training refusals are permanent failures (core/exit_status.h: exit 78, which
// troupe-scheduler does not restart); prepare, sample and plot exit 1.
TEST(TrainMoeCli, ErrorsNameTheProblem) {
  const std::string dir = temp_dir("errors");
  CliResult none = train_moe({});
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.out.find("--config"), std::string::npos);

  CliResult missing_input = train_moe({"prepare", "--input", dir + "/nope", "--out", dir + "/data"});
  EXPECT_EQ(missing_input.code, 1);
  EXPECT_NE(missing_input.out.find(dir + "/nope does not exist"), std::string::npos) << missing_input.out;

  CliResult no_data = train_moe({"--config", write_config(dir, dir + "/no_data"), "--run-dir", dir + "/run"});
  EXPECT_EQ(no_data.code, troupe::kExitPermanentFailure);
  EXPECT_NE(no_data.out.find(dir + "/no_data"), std::string::npos) << no_data.out;
  EXPECT_NE(no_data.out.find("prepare"), std::string::npos) << no_data.out;

  CliResult bad_key = train_moe({"--config", write_config(dir, dir + "/d"), "--set", "model.d_modle=64"});
  EXPECT_EQ(bad_key.code, troupe::kExitPermanentFailure);
  EXPECT_NE(bad_key.out.find("unknown key 'model.d_modle'"), std::string::npos) << bad_key.out;

  CliResult bad_file_key = train_moe({"--config", write_config(dir, dir + "/d", "[optimizer]\nlr = 3\n")});
  EXPECT_EQ(bad_file_key.code, troupe::kExitPermanentFailure);
  EXPECT_NE(bad_file_key.out.find("optimizer.lr"), std::string::npos) << bad_file_key.out;

  CliResult bad_value = train_moe({"--config", write_config(dir, dir + "/d"), "--set", "model.moe.router=\"argmax\""});
  EXPECT_EQ(bad_value.code, troupe::kExitPermanentFailure);
  EXPECT_NE(bad_value.out.find("model.moe.router"), std::string::npos) << bad_value.out;

  // A multi-rank layout is trained by the distributed mode (tests/training); one that
  // does not fit the model is refused when the config is read.
  CliResult layout = train_moe({"--config", write_config(dir, dir + "/d"), "--set", "parallel.n=4"});
  EXPECT_EQ(layout.code, troupe::kExitPermanentFailure);
  EXPECT_NE(layout.out.find("parallel.n=4 must divide model.n_heads=4 and model.n_kv_heads=2"), std::string::npos)
      << layout.out;

  CliResult layout2 = train_moe({"--config", write_config(dir, dir + "/d"), "--parallel", "pp=4,n=2"});
  EXPECT_EQ(layout2.code, troupe::kExitPermanentFailure);
  EXPECT_NE(layout2.out.find("parallel.pp=4 does not divide model.n_layers=2"), std::string::npos) << layout2.out;
  CliResult bad_layout = train_moe({"--config", write_config(dir, dir + "/d"), "--parallel", "tp=2"});
  EXPECT_EQ(bad_layout.code, 2);
  EXPECT_NE(bad_layout.out.find("--parallel: unknown key 'tp'"), std::string::npos) << bad_layout.out;
  // The flag is read by core's layout parser: the short form, and its errors.
  CliResult short_form = train_moe({"--config", write_config(dir, dir + "/d"), "--parallel", "4x1x2"});
  EXPECT_EQ(short_form.code, troupe::kExitPermanentFailure);
  EXPECT_NE(short_form.out.find("parallel.pp=4 does not divide model.n_layers=2"), std::string::npos)
      << short_form.out;
  CliResult zero =
      train_moe({"--config", write_config(dir, dir + "/d"), "--parallel", "n=0,dispatch=allgather"});
  EXPECT_EQ(zero.code, 2);
  EXPECT_NE(zero.out.find("--parallel: parallel layout 'n=0,dispatch=allgather': n must be >= 1, got 0"),
            std::string::npos)
      << zero.out;
  CliResult twice = train_moe({"--config", write_config(dir, dir + "/d"), "--parallel", "pp=1,pp=2"});
  EXPECT_EQ(twice.code, 2);
  EXPECT_NE(twice.out.find("key 'pp' given twice"), std::string::npos) << twice.out;

  // bf16 expert gradients with several micro-batches a step (this config has 2): refused,
  // since the later ones would add to them in bf16.
  CliResult bf16_grads =
      train_moe({"--config", write_config(dir, dir + "/d"), "--set", "train.expert_grads=bf16"});
  EXPECT_EQ(bf16_grads.code, troupe::kExitPermanentFailure);
  EXPECT_NE(bf16_grads.out.find("'train.expert_grads' = \"bf16\" needs one micro-batch per step"),
            std::string::npos)
      << bf16_grads.out;

  CliResult no_config = train_moe({"--config", dir + "/missing.toml"});
  EXPECT_EQ(no_config.code, troupe::kExitPermanentFailure);
  EXPECT_NE(no_config.out.find("missing.toml"), std::string::npos) << no_config.out;

  CliResult no_run = train_moe({"sample", "--run", dir + "/no_run"});
  EXPECT_EQ(no_run.code, 1);
  EXPECT_NE(no_run.out.find("does not exist"), std::string::npos) << no_run.out;

  // Fault injection is a [test] key: a run without --allow-test-config refuses it by name.
  CliResult fenced =
      train_moe({"--config", write_config(dir, dir + "/d"), "--set", "test.inject=\"kill@2:any:0\""});
  EXPECT_EQ(fenced.code, troupe::kExitPermanentFailure);
  EXPECT_NE(fenced.out.find("sets 'test.inject' of the [bench]/[test] sections"), std::string::npos)
      << fenced.out;
  EXPECT_NE(fenced.out.find("--allow-test-config"), std::string::npos) << fenced.out;
  // Its old name says where it went.
  CliResult moved =
      train_moe({"--config", write_config(dir, dir + "/d"), "--set", "elastic.inject=\"kill@2:any:0\""});
  EXPECT_EQ(moved.code, troupe::kExitPermanentFailure);
  EXPECT_NE(moved.out.find("key 'elastic.inject' is now 'test.inject'"), std::string::npos) << moved.out;
  // What needs the worker in a process of its own is refused in one process, by name.
  CliResult inject = train_moe({"--config", write_config(dir, dir + "/d"), "--set",
                                "test.inject=\"kill@2:any:0\"", "--allow-test-config"});
  EXPECT_EQ(inject.code, troupe::kExitPermanentFailure);
  EXPECT_NE(inject.out.find("test.inject (faults are injected into worker processes) needs the worker in a "
                            "process of its own: set elastic.isolate_workers = true"),
            std::string::npos)
      << inject.out;
  CliResult grow = train_moe({"--config", write_config(dir, dir + "/d"), "--set", "elastic.max_dp=2"});
  EXPECT_EQ(grow.code, troupe::kExitPermanentFailure);
  EXPECT_NE(grow.out.find("elastic.max_dp > 1"), std::string::npos) << grow.out;
  CliResult window =
      train_moe({"--config", write_config(dir, dir + "/d"), "--set", "train.steps_in_flight=0"});
  EXPECT_EQ(window.code, troupe::kExitPermanentFailure);
  EXPECT_NE(window.out.find("'train.steps_in_flight' must be in [1, 8] (got 0)"), std::string::npos)
      << window.out;
  if (!HasFailure()) fs::remove_all(dir);
}

// The worker's command queue: with every step in flight (train.steps_in_flight = steps)
// each step's command is queued before the worker reports the step before it, so the
// worker never waits for its driver between steps; with one in flight the next step's
// command is only sent once the report has arrived (the queue holds at most the step's
// evaluation). The losses are the same either way, and with the worker in a child process
// (elastic.isolate_workers).
TEST(TrainMoeCli, CommandsInFlight) {
  const std::string dir = temp_dir("window");
  const std::string corpus = make_corpus(dir);
  CliResult p = train_moe(
      {"prepare", "--input", corpus, "--out", dir + "/data", "--vocab", "320", "--val-fraction", "0.2"});
  ASSERT_EQ(p.code, 0) << p.out;
  const std::string cfg = write_config(dir, dir + "/data");
  const auto records = [](const std::string& run) {
    std::vector<nlohmann::json> out;
    std::ifstream mf(run + "/metrics.jsonl");
    std::string line;
    while (std::getline(mf, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) out.push_back(j);
    }
    return out;
  };
  CliResult ahead = train_moe({"--config", cfg, "--run-dir", dir + "/ahead", "--set", "train.steps=6",
                               "--set", "train.steps_in_flight=6"});
  ASSERT_EQ(ahead.code, 0) << ahead.out;
  CliResult one = train_moe({"--config", cfg, "--run-dir", dir + "/one", "--set", "train.steps=6", "--set",
                             "train.steps_in_flight=1"});
  ASSERT_EQ(one.code, 0) << one.out;
  CliResult child = train_moe({"--config", cfg, "--run-dir", dir + "/child", "--set", "train.steps=6",
                               "--set", "elastic.isolate_workers=true"});
  ASSERT_EQ(child.code, 0) << child.out;
  const auto a = records(dir + "/ahead"), o = records(dir + "/one"), c = records(dir + "/child");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(o.size(), 6u);
  ASSERT_EQ(c.size(), 6u);
  std::string waits_ahead, waits_one;
  for (size_t i = 0; i < a.size(); ++i) {
    // Every step's report was sent with the next command (the next step, or the final
    // evaluation after step 6) already queued at the worker.
    EXPECT_TRUE(a[i]["next_queued"].get<bool>()) << "steps_in_flight=6, step " << i + 1;
    // With one in flight nothing but an evaluation (train.eval_every = 2: after steps 2, 4,
    // 6) can be queued behind a step: the next step is sent only on its report. The
    // evaluation is sent right after its step, in a message of its own; on a loaded machine
    // the step can be done before it arrives (a fresh clone's run saw that once at step 4),
    // so after an even step either is right.
    if ((i + 1) % 2 != 0) {
      EXPECT_FALSE(o[i]["next_queued"].get<bool>()) << "steps_in_flight=1, step " << i + 1;
    }
    EXPECT_EQ(a[i]["loss"].get<double>(), o[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i]["loss"].get<double>(), c[i]["loss"].get<double>()) << "step " << i + 1;
    if (i > 0) {
      waits_ahead += fmt_ms(a[i]["command_wait_ms"].get<double>());
      waits_one += fmt_ms(o[i]["command_wait_ms"].get<double>());
    }
  }
  std::printf(
      "[commands in flight] the worker's wait for the command of steps 2..6 (ms):%s with 6 in flight,%s "
      "with 1\n",
      waits_ahead.c_str(), waits_one.c_str());
  // The isolated worker was a child process.
  std::ifstream ev(dir + "/child/events.jsonl");
  std::string line;
  int children = 0;
  while (std::getline(ev, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "worker_started" && !j.value("in_process", false)) ++children;
  }
  EXPECT_EQ(children, 1);
  if (!HasFailure()) fs::remove_all(dir);
}

// --backend: an unknown name is refused; cuda on a host without a GPU (or a build without
// CUDA) fails before any work with a message that says which.
TEST(TrainMoeCli, BackendErrors) {
  const std::string dir = temp_dir("backend");
  // Both are permanent: a restart would meet them again (core/exit_status.h).
  CliResult unknown = train_moe({"--config", dir + "/missing.toml", "--backend", "tpu"});
  EXPECT_EQ(unknown.code, troupe::kExitPermanentFailure);
  EXPECT_NE(unknown.out.find("--backend must be cpu or cuda, not 'tpu'"), std::string::npos) << unknown.out;
  CliResult cuda = train_moe({"--config", dir + "/missing.toml", "--backend", "cuda"});
  EXPECT_EQ(cuda.code, troupe::kExitPermanentFailure);
  if (!fs::exists("/dev/nvidia0")) {
    const bool says_why = cuda.out.find("no CUDA device is visible") != std::string::npos ||
                          cuda.out.find("has no CUDA support") != std::string::npos;
    EXPECT_TRUE(says_why) << cuda.out;
  } else {
    EXPECT_NE(cuda.out.find("missing.toml"), std::string::npos) << cuda.out;  // got past the device
  }
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
