// training/stage/step_graph.h — defines StepGraph, one training step recorded once as a
// CUDA graph on a device Ctx's stream and replayed, and StatsReadback, the step's one
// asynchronous device->host copy of its statistics into pinned memory. The Stage's step
// engine (stage.h, "Step engine") uses both; neither knows what a step computes.
//
// StepGraph: begin_capture() starts recording the Ctx's stream with the caching
// allocator's graph pool (core/cuda/caching_allocator.h: what the captured work allocates
// stays the graph's, so the addresses it replays into are never handed to anyone else);
// end_capture() instantiates and uploads it; replay() enqueues one launch. The captured
// work must not wait on the host (a read-back, a stream synchronisation): end_capture
// then fails naming the CUDA error. Work on other streams must fork from and join back to
// the captured stream with events inside the capture (CommTime::launch / await do).
// A CUDA Ctx whose allocator is the CudaCachingAllocator; CUDA builds only.
//
// StatsReadback: `slots` pinned host buffers, each filled by start(slot, src) (a copy
// enqueued on the Ctx's stream after everything enqueued before it, and an event) and
// read by wait(slot), which waits for that copy alone: work enqueued after start() keeps
// running. On a CPU Ctx start() copies at once. Two slots let step k+1 be launched before
// step k's statistics are read.
//
// DeviceMarks: timing events around steps on the Ctx's stream: begin(slot) before a step's
// first op, end(slot) after its last; once end(slot) has completed, ms(slot) is the device
// time between them and gap_ms(prev, slot) the time from prev's end to slot's begin (what
// the device spent between two steps: idle, or on work enqueued between them such as an
// evaluation). Between begin and end the host thread is inside an NVTX range "step" (what
// profilers select a step's kernels by). No-ops on a CPU Ctx (the times are then -1).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "layers/context.h"

namespace troupe::training {

class StepGraph {
 public:
  explicit StepGraph(const layers::Ctx& c);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  Status begin_capture();
  // Ends the capture; on failure (something in it waited on the host) the graph stays
  // empty and the stream leaves capture mode.
  Status end_capture();
  bool capturing() const { return capturing_; }
  bool captured() const;
  void replay() const;
  // Destroys the graph and gives its memory back (waits for the device first).
  void reset();
  // Bytes the graph owns (its activations and temporaries), reserved while it lives.
  size_t pool_bytes() const;

 private:
  struct Cuda;
  std::unique_ptr<Cuda> cuda_;
  bool capturing_ = false;
};

class StatsReadback {
 public:
  StatsReadback(const layers::Ctx& c, int slots);
  ~StatsReadback();
  StatsReadback(const StatsReadback&) = delete;
  StatsReadback& operator=(const StatsReadback&) = delete;

  // src: f32, contiguous, on the Ctx's device (or the host for a CPU Ctx).
  void start(int slot, const Tensor& src);
  // The values copied by the last start(slot, ...), once that copy is done.
  const float* wait(int slot);

 private:
  struct Slot;
  layers::Ctx ctx_;
  std::vector<std::unique_ptr<Slot>> slots_;
};

class DeviceMarks {
 public:
  DeviceMarks(const layers::Ctx& c, int slots);
  ~DeviceMarks();
  DeviceMarks(const DeviceMarks&) = delete;
  DeviceMarks& operator=(const DeviceMarks&) = delete;

  void begin(int slot);
  void end(int slot);
  double ms(int slot) const;  // waits for end(slot)
  double gap_ms(int prev, int slot) const;

 private:
  struct Events;
  layers::Ctx ctx_;
  std::vector<std::unique_ptr<Events>> slots_;
};

}  // namespace troupe::training
