// observe/metric.h — defines Metric, one named reading of a health report ("proc_run_delay"
// = 0.02), and the table of every health metric a worker reports: its unit and what it
// means (kHealthMetrics), which `troupe status --health`, Prometheus and the detector use.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace troupe::observe {

struct Metric {
  std::string name;
  double value = 0;
};

struct MetricInfo {
  std::string_view name;
  std::string_view unit;
  std::string_view help;
};

// Every metric a worker may report (host_* from /proc, proc_* of the worker process,
// gpu_* from NVML, step_* from its last steps). A report holds those it could read.
inline constexpr MetricInfo kHealthMetrics[] = {
    {"host_cpu_util", "fraction", "share of the host's CPU time busy (/proc/stat)"},
    {"host_cpu_steal", "fraction", "share of the host's CPU time stolen by the hypervisor"},
    {"host_cpu_iowait", "fraction", "share of the host's CPU time idle waiting for I/O"},
    {"host_mem_used_bytes", "bytes", "MemTotal - MemAvailable (/proc/meminfo)"},
    {"host_mem_available_bytes", "bytes", "MemAvailable"},
    {"host_net_rx_bytes_per_s", "bytes/s", "received on the host's interfaces other than lo (/proc/net/dev)"},
    {"host_net_tx_bytes_per_s", "bytes/s", "sent on the host's interfaces other than lo"},
    {"host_tcp_retrans_per_s", "segments/s", "TCP segments retransmitted (/proc/net/snmp RetransSegs)"},
    {"host_tcp_out_per_s", "segments/s", "TCP segments sent"},
    {"proc_cpu", "CPUs", "CPU time of the worker process per second (user + system)"},
    {"proc_run_delay", "s/s", "time the worker's threads waited on a run queue per second (schedstat)"},
    {"proc_throttled", "s/s", "time the worker's cgroup was throttled by its CPU quota per second"},
    {"proc_rss_bytes", "bytes", "resident memory of the worker process"},
    {"proc_io_write_bytes_per_s", "bytes/s",
     "bytes the worker caused to be written to storage (/proc/<pid>/io)"},
    {"proc_blkio_delay", "s/s", "time the worker waited for block I/O per second (delay accounting)"},
    {"step_compute_ms", "ms",
     "the worker's compute time per step (step time less communication), last steps"},
    {"step_comm_ms", "ms", "the worker's communication (and waiting) time per step, last steps"},
    {"step_ms", "ms", "the worker's step time, last steps"},
    {"step_io_ms", "ms", "the worker's checkpoint write time per write, last writes"},
    {"steps_per_s", "1/s", "steps the worker completed per second"},
    {"gpu_sm_clock_mhz", "MHz", "SM clock (NVML)"},
    {"gpu_power_w", "W", "power draw"},
    {"gpu_temp_c", "C", "GPU temperature"},
    {"gpu_util", "fraction", "share of time a kernel ran (NVML utilisation)"},
    {"gpu_mem_util", "fraction", "share of time device memory was read or written"},
    {"gpu_mem_used_bytes", "bytes", "device memory in use"},
    {"gpu_ecc_corrected", "errors", "corrected ECC errors since the driver loaded (volatile)"},
    {"gpu_ecc_uncorrected", "errors", "uncorrected ECC errors since the driver loaded (volatile)"},
    {"gpu_xid_errors", "events", "critical XID events seen by this worker since it started"},
    {"gpu_last_xid", "code", "the last critical XID code seen (0: none)"},
    {"gpu_throttle_reasons", "bitmask", "NVML clock throttle reasons (0: none)"},
    {"gpu_pcie_tx_bytes_per_s", "bytes/s", "PCIe transmit throughput"},
    {"gpu_pcie_rx_bytes_per_s", "bytes/s", "PCIe receive throughput"},
    {"gpu_nvlink_tx_bytes_per_s", "bytes/s", "NVLink data transmitted, all links"},
    {"gpu_nvlink_rx_bytes_per_s", "bytes/s", "NVLink data received, all links"},
};

const MetricInfo* find_metric_info(std::string_view name);

}  // namespace troupe::observe
