// swarm_torch: an existing C++ trainer on libtorch that joins a libgwtf swarm.
//
// The model is swarm_mlp's (mlp_model.hpp: a token embedding and a softmax
// head on the data holders, one tanh layer per relay stage), but its
// forward and backward are libtorch's: torch tensors and autograd, as a
// trainer written against libtorch has them. What it shows:
// - no copies at the boundary: a task's input is a tensor over the frame
//   the library lent (`torch::from_blob`, valid until the task is
//   answered), and a forward's output is computed into a frame allocated
//   from the library's pool, viewed as a tensor (`_out` ops); an input
//   gradient, which autograd allocates, is copied into its frame once;
// - the parameters are tensors over the stage's own buffers, which the
//   library's state transfer, digest and Adam update read and write;
// - each microbatch's parameter gradient (autograd's `.grad()`) is kept
//   apart until the stage aggregates, so a microbatch computed twice
//   after a recovery is counted once.
// A relay keeps its input and recomputes its forward under autograd at
// the backward (activation recomputation), so nothing but plain buffers
// lives between tasks.
//
//   swarm_torch --listen 127.0.0.1:7001 --key-file KEY --holder --peer ... (as swarm_mlp)
//
// Built by `make TORCH=DIR` in c-examples/ (DIR: the installed `torch`
// package, which ships libtorch's headers and libraries; the default is
// the one in the checkout's .venv).
#include "mlp_model.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#include <cstring>
#include <vector>

namespace {

using torch::Tensor;

// A float tensor over `n` values at `p` (not owned: the caller keeps the
// memory alive while the tensor is used).
Tensor view(const void *p, std::vector<int64_t> shape) {
    return torch::from_blob(const_cast<void *>(p), shape, torch::kFloat32);
}

// A parameter as a leaf tensor over its buffer, its gradient to come.
Tensor param(Piece &p, std::vector<int64_t> shape) {
    return view(p.w.data(), std::move(shape)).requires_grad_(true);
}

// The gradient autograd left in `t`, as the stage keeps it.
std::vector<float> grad_of(const Tensor &t) {
    Tensor g = t.grad().contiguous();
    return std::vector<float>(g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
}

Tensor token_tensor(const std::vector<int> &v) {
    std::vector<int64_t> w(v.begin(), v.end());
    return torch::tensor(w, torch::kInt64);
}

class TorchTrainer : public Trainer {
public:
    using Trainer::Trainer;

protected:
    // A libtorch error fails the task with its message (the library then
    // sends the microbatch elsewhere); it never unwinds through the library.
    std::string compute(const gwtf_peer_task &t) override {
        try {
            return compute_torch(t);
        } catch (const c10::Error &e) {
            return std::string("libtorch: ") + e.what_without_backtrace();
        }
    }

private:
    std::string compute_torch(const gwtf_peer_task &t) {
        Mb mb = mb_of(t.mb);
        switch (t.kind) {
        case GWTF_TASK_KIND_EMBED: {
            Kept &k = draw_microbatch(st_, t.mb);
            int d = width(0);
            torch::NoGradGuard no_grad;
            Tensor E = view(st_.pieces[0].w.data(), {VOCAB, d});
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            Tensor out = view(f.data<float>(), {BATCH, d});
            torch::index_select_out(out, E, 0, token_tensor(k.tokens));
            peer_.done(t.id, f);
            return "";
        }
        case GWTF_TASK_KIND_EMBED_BACKWARD: {
            auto k = st_.kept.find(mb);
            if (k == st_.kept.end()) return "embedding backward of a microbatch not embedded";
            int d = width(0);
            Tensor E = param(st_.pieces[0], {VOCAB, d});
            Tensor h = E.index_select(0, token_tensor(k->second.tokens));
            h.backward(view(t.input, {BATCH, d}));
            st_.keep_grad(mb, 0, grad_of(E));
            st_.kept.erase(k);
            peer_.done(t.id);
            return "";
        }
        case GWTF_TASK_KIND_LOSS: {
            auto k = st_.kept.find(mb);
            if (k == st_.kept.end()) return "loss of a microbatch this holder did not embed";
            int d = width(st_.relay_stages);
            Tensor W = param(st_.pieces[1], {d, VOCAB});
            Tensor b = param(st_.pieces[2], {VOCAB});
            // The activations that came, as a leaf: their gradient goes back.
            Tensor h = view(t.input, {BATCH, d}).detach().requires_grad_(true);
            Tensor loss = torch::cross_entropy_loss(torch::addmm(b, h, W),
                                                    token_tensor(k->second.targets));
            loss.backward();
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            view(f.data<float>(), {BATCH, d}).copy_(h.grad());
            st_.keep_grad(mb, 1, grad_of(W));
            st_.keep_grad(mb, 2, grad_of(b));
            peer_.done_loss(t.id, loss.item<float>(), f);
            return "";
        }
        case GWTF_TASK_KIND_FORWARD: {
            int din = width(st_.stage - 1), dout = width(st_.stage);
            Kept &k = st_.kept[mb];
            k.in.assign(reinterpret_cast<const float *>(t.input),
                        reinterpret_cast<const float *>(t.input) + (size_t)BATCH * din);
            torch::NoGradGuard no_grad;
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            Tensor W = view(st_.pieces[0].w.data(), {dout, din});
            Tensor b = view(st_.pieces[1].w.data(), {dout});
            // tanh(x W^T + b), computed into the frame.
            Tensor out = view(f.data<float>(), {BATCH, dout});
            torch::addmm_out(out, b, view(k.in.data(), {BATCH, din}), W.t()).tanh_();
            peer_.done(t.id, f);
            return "";
        }
        case GWTF_TASK_KIND_BACKWARD: {
            auto k = st_.kept.find(mb);
            if (k == st_.kept.end()) return "backward of a microbatch whose forward is not kept";
            int din = width(st_.stage - 1), dout = width(st_.stage);
            Tensor x = view(k->second.in.data(), {BATCH, din}).detach().requires_grad_(true);
            Tensor W = param(st_.pieces[0], {dout, din});
            Tensor b = param(st_.pieces[1], {dout});
            torch::tanh(torch::addmm(b, x, W.t())).backward(view(t.input, {BATCH, dout}));
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            view(f.data<float>(), {BATCH, din}).copy_(x.grad());
            st_.keep_grad(mb, 0, grad_of(W));
            st_.keep_grad(mb, 1, grad_of(b));
            st_.kept.erase(k);
            peer_.done(t.id, f);
            return "";
        }
        }
        return "not a compute task";
    }
};

}  // namespace

int main(int argc, char **argv) {
    // One thread per process: a local swarm shares the cores, and the sums
    // come out in one order.
    torch::set_num_threads(1);
    return swarm::main_guard("swarm_torch", [&] {
        return serve_model<TorchTrainer>("swarm_torch", swarm::parse(argc, argv));
    });
}
