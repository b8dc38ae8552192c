// comm/verbs_transport.cc — VerbsTransport: BulkTransport over libibverbs RC queue pairs
// (one per peer) with RDMA write with immediate, and rdma_device_count() /
// make_bulk_transport(), which choose between verbs and TCP.
//
// Out-of-band exchange through the RendezvousStore, under "<ns>/<name>/":
//   qp/<from>/<to>  = QpInfo {qpn, psn, lid, gid, mtu} of from's QP towards `to`
//   buf/<rank>/<id> = BufInfo {addr, rkey, bytes} of a registered buffer
// The immediate carries (buffer id << 24 | tag) in network byte order; every QP keeps
// kRecvDepth zero-length receives posted (write-with-immediate consumes one) and reposts
// after each. Always compiled; exercised only where an RDMA device exists (CI has none).
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "comm/bulk_transport.h"

namespace troupe::comm {

int rdma_device_count() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) return 0;  // ENOSYS without a kernel RDMA subsystem
  ibv_free_device_list(list);
  return n;
}

namespace {

constexpr int kRecvDepth = 256;
constexpr int kSendDepth = 1024;

struct QpInfo {
  uint32_t qpn;
  uint32_t psn;
  uint16_t lid;
  uint8_t mtu;
  uint8_t reserved;
  uint8_t gid[16];
};

struct BufInfo {
  uint64_t addr;
  uint32_t rkey;
  uint32_t reserved;
  uint64_t bytes;
};

template <typename T>
std::string to_bytes(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
Result<T> from_bytes(const std::string& s, std::string_view what) {
  if (s.size() != sizeof(T))
    return data_loss("bulk verbs: {} has {} bytes, expected {}", what, s.size(), sizeof(T));
  T v;
  std::memcpy(&v, s.data(), sizeof(T));
  return v;
}

struct WriteRecord {
  int peer;
  uint32_t dst_buffer;
  uint32_t tag;
  uint64_t bytes;
};

class VerbsTransport final : public BulkTransport {
 public:
  VerbsTransport(const BulkSpec& spec)
      : rank_(spec.rank),
        size_(spec.size),
        timeout_(spec.timeout),
        store_(*spec.store),
        prefix_(spec.ns.key(spec.name) + "/"),
        qps_(spec.size, nullptr) {}

  ~VerbsTransport() override {
    for (auto* qp : qps_)
      if (qp) ibv_destroy_qp(qp);
    for (auto& [id, mr] : mrs_) ibv_dereg_mr(mr);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (ctx_) ibv_close_device(ctx_);
  }

  Status open_and_connect() {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr || n == 0) {
      if (list) ibv_free_device_list(list);
      return unavailable("bulk verbs: no RDMA device (ibv_get_device_list: {})",
                         n == 0 && errno ? std::strerror(errno) : "empty");
    }
    device_name_ = ibv_get_device_name(list[0]);
    ctx_ = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    if (!ctx_) return unavailable("bulk verbs: ibv_open_device({}): {}", device_name_, std::strerror(errno));
    ibv_port_attr port{};
    if (ibv_query_port(ctx_, kPort, &port) != 0)
      return unavailable("bulk verbs: ibv_query_port: {}", std::strerror(errno));
    if (port.state != IBV_PORT_ACTIVE)
      return unavailable("bulk verbs: {} port {} is not active", device_name_, kPort);
    roce_ = port.link_layer == IBV_LINK_LAYER_ETHERNET;
    mtu_ = port.active_mtu;
    lid_ = port.lid;
    if (ibv_query_gid(ctx_, kPort, kGidIndex, &gid_) != 0) std::memset(&gid_, 0, sizeof(gid_));
    pd_ = ibv_alloc_pd(ctx_);
    if (!pd_) return unavailable("bulk verbs: ibv_alloc_pd: {}", std::strerror(errno));
    cq_ = ibv_create_cq(ctx_, (kSendDepth + kRecvDepth) * std::max(1, size_ - 1), nullptr, nullptr, 0);
    if (!cq_) return unavailable("bulk verbs: ibv_create_cq: {}", std::strerror(errno));

    std::mt19937 gen(std::random_device{}());
    std::vector<uint32_t> psn(size_);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      ibv_qp_init_attr init{};
      init.send_cq = cq_;
      init.recv_cq = cq_;
      init.qp_type = IBV_QPT_RC;
      init.cap.max_send_wr = kSendDepth;
      init.cap.max_recv_wr = kRecvDepth;
      init.cap.max_send_sge = 1;
      init.cap.max_recv_sge = 1;
      ibv_qp* qp = ibv_create_qp(pd_, &init);
      if (!qp) return unavailable("bulk verbs: ibv_create_qp: {}", std::strerror(errno));
      qps_[p] = qp;
      qp_peer_[qp->qp_num] = p;
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = kPort;
      a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
      if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
        return unavailable("bulk verbs: QP to INIT: {}", std::strerror(errno));
      }
      for (int i = 0; i < kRecvDepth; ++i) TROUPE_RETURN_IF_ERROR(post_recv(qp));
      psn[p] = gen() & 0xFFFFFF;
      QpInfo info{};
      info.qpn = qp->qp_num;
      info.psn = psn[p];
      info.lid = lid_;
      info.mtu = static_cast<uint8_t>(mtu_);
      std::memcpy(info.gid, gid_.raw, 16);
      TROUPE_RETURN_IF_ERROR(store_.set(fmt::format("{}qp/{}/{}", prefix_, rank_, p), to_bytes(info)));
    }
    const Deadline deadline = deadline_in(timeout_);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      TROUPE_ASSIGN_OR_RETURN(std::string raw,
                              store_.get(fmt::format("{}qp/{}/{}", prefix_, p, rank_), deadline));
      TROUPE_ASSIGN_OR_RETURN(QpInfo peer, from_bytes<QpInfo>(raw, "queue-pair info"));
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_RTR;
      a.path_mtu = static_cast<ibv_mtu>(std::min<int>(peer.mtu, mtu_));
      a.dest_qp_num = peer.qpn;
      a.rq_psn = peer.psn;
      a.max_dest_rd_atomic = 1;
      a.min_rnr_timer = 12;
      a.ah_attr.port_num = kPort;
      a.ah_attr.dlid = peer.lid;
      if (roce_) {
        a.ah_attr.is_global = 1;
        std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
        a.ah_attr.grh.sgid_index = kGidIndex;
        a.ah_attr.grh.hop_limit = 1;
      }
      if (ibv_modify_qp(qps_[p], &a,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
        return unavailable("bulk verbs: QP to RTR (peer {}): {}", p, std::strerror(errno));
      }
      ibv_qp_attr b{};
      b.qp_state = IBV_QPS_RTS;
      b.timeout = 14;
      b.retry_cnt = 7;
      b.rnr_retry = 7;
      b.sq_psn = psn[p];
      b.max_rd_atomic = 1;
      if (ibv_modify_qp(qps_[p], &b,
                        IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                            IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
        return unavailable("bulk verbs: QP to RTS (peer {}): {}", p, std::strerror(errno));
      }
    }
    return ok_status();
  }

  std::string_view kind() const override { return "verbs"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status register_buffer(uint32_t id, void* data, uint64_t bytes) override {
    if (id >= kMaxBuffers) return invalid_argument("bulk buffer id {} >= {}", id, kMaxBuffers);
    std::lock_guard<std::mutex> lock(mu_);
    if (mrs_.count(id)) return already_exists("bulk buffer {} already registered", id);
    ibv_mr* mr = ibv_reg_mr(pd_, data, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!mr) return unavailable("bulk verbs: ibv_reg_mr({} bytes): {}", bytes, std::strerror(errno));
    mrs_[id] = mr;
    BufInfo info{reinterpret_cast<uint64_t>(data), mr->rkey, 0, bytes};
    return store_.set(fmt::format("{}buf/{}/{}", prefix_, rank_, id), to_bytes(info));
  }

  Status write(int peer, uint32_t src_buffer, uint64_t src_offset, uint32_t dst_buffer, uint64_t dst_offset,
               uint64_t bytes, uint32_t tag) override {
    if (peer < 0 || peer >= size_ || peer == rank_) return invalid_argument("bulk write: bad peer {}", peer);
    if (tag > kMaxTag) return invalid_argument("bulk write: tag {} > {}", tag, kMaxTag);
    if (dst_buffer >= kMaxBuffers)
      return invalid_argument("bulk write: buffer id {} >= {}", dst_buffer, kMaxBuffers);
    // RC messages are limited by the port's max_msg_sz, 2 GiB on current HCAs.
    if (bytes > (uint64_t{1} << 31))
      return invalid_argument("bulk verbs: one write is at most 2 GiB, got {}", bytes);
    std::lock_guard<std::mutex> lock(mu_);
    auto mit = mrs_.find(src_buffer);
    if (mit == mrs_.end()) return not_found("bulk write: source buffer {} not registered", src_buffer);
    ibv_mr* mr = mit->second;
    if (src_offset > mr->length || bytes > mr->length - src_offset) {
      return out_of_range("bulk write: [{}, +{}) outside source buffer {}", src_offset, bytes, src_buffer);
    }
    auto key = std::make_pair(peer, dst_buffer);
    auto rit = remote_.find(key);
    if (rit == remote_.end()) {
      TROUPE_ASSIGN_OR_RETURN(
          std::string raw,
          store_.get(fmt::format("{}buf/{}/{}", prefix_, peer, dst_buffer), deadline_in(timeout_)));
      TROUPE_ASSIGN_OR_RETURN(BufInfo info, from_bytes<BufInfo>(raw, "buffer info"));
      rit = remote_.emplace(key, info).first;
    }
    const BufInfo& dst = rit->second;
    if (dst_offset > dst.bytes || bytes > dst.bytes - dst_offset) {
      return out_of_range("bulk write: [{}, +{}) outside rank {}'s buffer {} of {} bytes", dst_offset, bytes,
                          peer, dst_buffer, dst.bytes);
    }
    uint64_t wr_id = next_wr_++;
    ibv_sge sge{};
    sge.addr = reinterpret_cast<uint64_t>(mr->addr) + src_offset;
    sge.length = static_cast<uint32_t>(bytes);
    sge.lkey = mr->lkey;
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl((dst_buffer << 24) | tag);
    wr.wr.rdma.remote_addr = dst.addr + dst_offset;
    wr.wr.rdma.rkey = dst.rkey;
    if (int rc = ibv_post_send(qps_[peer], &wr, &bad); rc != 0) {
      return unavailable("bulk verbs: ibv_post_send to rank {}: {}", peer, std::strerror(rc));
    }
    writes_[wr_id] = WriteRecord{peer, dst_buffer, tag, bytes};
    return ok_status();
  }

  Result<std::vector<BulkCompletion>> poll(Deadline deadline, size_t max) override {
    std::vector<BulkCompletion> out;
    ibv_wc wcs[16];
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        int n = ibv_poll_cq(cq_, static_cast<int>(std::min<size_t>(16, max - out.size())), wcs);
        if (n < 0) return unavailable("bulk verbs: ibv_poll_cq failed");
        for (int i = 0; i < n; ++i) TROUPE_RETURN_IF_ERROR(translate(wcs[i], out));
      }
      if (!out.empty() || Clock::now() >= deadline) return out;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  static constexpr uint8_t kPort = 1;
  static constexpr int kGidIndex = 0;

  static Status post_recv(ibv_qp* qp) {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = 0;
    wr.sg_list = nullptr;
    wr.num_sge = 0;
    if (int rc = ibv_post_recv(qp, &wr, &bad); rc != 0) {
      return unavailable("bulk verbs: ibv_post_recv: {}", std::strerror(rc));
    }
    return ok_status();
  }

  // Call with mu_ held.
  Status translate(const ibv_wc& wc, std::vector<BulkCompletion>& out) {
    auto pit = qp_peer_.find(wc.qp_num);
    int peer = pit == qp_peer_.end() ? -1 : pit->second;
    Status st = wc.status == IBV_WC_SUCCESS ? ok_status()
                                            : unavailable("bulk verbs: completion from rank {}: {}", peer,
                                                          ibv_wc_status_str(wc.status));
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM || (wc.status != IBV_WC_SUCCESS && wc.wr_id == 0)) {
      uint32_t imm = ntohl(wc.imm_data);
      out.push_back(
          BulkCompletion{BulkCompletion::Kind::kReceived, peer, imm >> 24, imm & kMaxTag, wc.byte_len, st});
      if (wc.status == IBV_WC_SUCCESS && peer >= 0) TROUPE_RETURN_IF_ERROR(post_recv(qps_[peer]));
      return ok_status();
    }
    auto wit = writes_.find(wc.wr_id);
    if (wit == writes_.end()) return ok_status();
    out.push_back(BulkCompletion{BulkCompletion::Kind::kWriteDone, wit->second.peer, wit->second.dst_buffer,
                                 wit->second.tag, wit->second.bytes, st});
    writes_.erase(wit);
    return ok_status();
  }

  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  RendezvousStore& store_;
  const std::string prefix_;
  std::string device_name_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  bool roce_ = false;
  ibv_mtu mtu_ = IBV_MTU_1024;
  uint16_t lid_ = 0;
  ibv_gid gid_{};
  std::vector<ibv_qp*> qps_;
  std::map<uint32_t, int> qp_peer_;

  std::mutex mu_;
  std::map<uint32_t, ibv_mr*> mrs_;
  std::map<std::pair<int, uint32_t>, BufInfo> remote_;
  std::map<uint64_t, WriteRecord> writes_;
  uint64_t next_wr_ = 1;
};

}  // namespace

Result<std::unique_ptr<BulkTransport>> make_verbs_transport(const BulkSpec& spec) {
  if (spec.store == nullptr) return invalid_argument("bulk transport: no rendezvous store");
  if (spec.size < 1 || spec.rank < 0 || spec.rank >= spec.size) {
    return invalid_argument("bulk transport: rank {} of {}", spec.rank, spec.size);
  }
  auto t = std::make_unique<VerbsTransport>(spec);
  TROUPE_RETURN_IF_ERROR(t->open_and_connect());
  return std::unique_ptr<BulkTransport>(std::move(t));
}

Result<std::unique_ptr<BulkTransport>> make_bulk_transport(const BulkSpec& spec, BulkKind kind) {
  switch (kind) {
    case BulkKind::kTcp:
      return make_tcp_transport(spec);
    case BulkKind::kVerbs:
      return make_verbs_transport(spec);
    case BulkKind::kAuto:
      break;
  }
  // Every rank must make the same choice: each sees the same kind of host here; a mixed
  // cluster should pass kTcp or kVerbs explicitly.
  if (rdma_device_count() > 0) return make_verbs_transport(spec);
  return make_tcp_transport(spec);
}

}  // namespace troupe::comm
