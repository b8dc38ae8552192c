// actors/training/device_timeline.h — defines DeviceTimeline, the device's own clock for a
// worker's steps: CUDA events on the Stage's stream around each step's enqueued work, so
// the worker can report how long the device worked on a step and how long it sat idle
// before the step's first op (waiting for the host or the driver). No-op on the CPU.
//
// Why events and not host clocks: a step launched ahead is enqueued while the device
// still runs the one before; only the stream's own timestamps say whether the device
// waited between them. An event completes when the stream reaches it: `begin(k)`
// (recorded just before step k's first op is enqueued) completes at
// max(the device finished what came before, the host recorded it), `end(k)` (recorded
// right after step k's last op is enqueued) when the device finished step k. So
// gap(k) = begin(k) - end(k-1) is the device's idle time between the two steps (plus one
// launch latency), and busy(k) = end(k) - begin(k) its time on step k.
//
// Thread contract: one thread (the worker's step thread) calls every method; the
// device must be current on it (the Stage binds it).
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "layers/context.h"

namespace troupe::training {

class DeviceTimeline {
 public:
  explicit DeviceTimeline(const layers::Ctx& ctx);
  ~DeviceTimeline();
  DeviceTimeline(const DeviceTimeline&) = delete;
  DeviceTimeline& operator=(const DeviceTimeline&) = delete;

  bool active() const { return impl_ != nullptr; }
  void begin(int64_t step);  // before the step's first op is enqueued
  void end(int64_t step);    // after its last op is enqueued
  struct Times {
    double device_ms = -1;              // end(step) - begin(step)
    double gap_ms = -1;                 // begin(step) - end(step - 1); -1 without a previous step
    double begin_ms = -1, end_ms = -1;  // on the timeline's own clock (its first event)
  };
  // Once step's end event has completed (after finish_step): its times; forgets the events
  // of older steps. All -1 on the CPU or for a step without both events.
  Times read(int64_t step);
  // Forgets every event (an interrupted step, a new epoch): the next gap starts afresh.
  void reset();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::training
