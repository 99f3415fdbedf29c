// optim.cpp: swarm::AdamW (torch.optim.AdamW's update written on plain tensors) and lr_at.
#include "stages/optim.h"

#include <cmath>
#include <map>

#include "runtime/errors.h"

namespace swarm {

double lr_at(const OptimizerSpec& opt, int64_t step, int64_t total_steps) {
  const int64_t warmup = opt.warmup_steps > 0 ? opt.warmup_steps : 0;
  if (step < warmup) return opt.lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (step <= warmup) return opt.lr;  // the cosine starts at lr (also when it has no length)
  const int64_t last = total_steps - 1;
  if (step >= last) return opt.min_lr;
  const double ratio = static_cast<double>(step - warmup) / static_cast<double>(last - warmup);
  const double pi = 3.14159265358979323846;
  return opt.min_lr + 0.5 * (1.0 + std::cos(pi * ratio)) * (opt.lr - opt.min_lr);
}

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, OptimizerSpec opt,
             int64_t total_steps)
    : params_(std::move(named_params)), opt_(opt), total_steps_(total_steps) {
  torch::NoGradGuard no_grad;
  for (const auto& np : params_) {
    m_.push_back(torch::zeros_like(np.second, torch::MemoryFormat::Contiguous));
    v_.push_back(torch::zeros_like(np.second, torch::MemoryFormat::Contiguous));
    decay_.push_back(np.second.dim() >= 2);
  }
}

double AdamW::step(int64_t samples, double grad_scale, int64_t lr_step, double lr_factor) {
  SWARM_CHECK(samples > 0, "an optimizer step needs at least one sample");
  SWARM_CHECK(grad_scale > 0, "a gradient scale is positive");
  SWARM_CHECK(lr_factor > 0, "a learning-rate factor is positive");
  torch::NoGradGuard no_grad;
  const double lr = lr_factor * lr_at(opt_, lr_step >= 0 ? lr_step : t_, total_steps_);
  if (constraint_) constraint_->project_grads(params_);

  // Mean gradient, and its L2 norm over the whole stage.
  std::vector<size_t> live;
  std::vector<torch::Tensor> norms;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor g = params_[i].second.grad();
    if (!g.defined()) continue;
    g.div_(static_cast<double>(samples) * grad_scale);
    live.push_back(i);
    norms.push_back(g.norm());
  }
  double norm = 0;
  if (!norms.empty()) norm = torch::stack(norms).norm().item<double>();
  if (opt_.grad_clip > 0) {
    const double coef = opt_.grad_clip / (norm + 1e-6);
    if (coef < 1.0) {
      for (size_t i : live) params_[i].second.grad().mul_(coef);
    }
  }

  ++t_;
  if (opt_.name == "sgd") {
    for (size_t i : live) {
      torch::Tensor p = params_[i].second.data();
      if (decay_[i] && opt_.weight_decay != 0) p.mul_(1.0 - lr * opt_.weight_decay);
      p.add_(params_[i].second.grad(), -lr);
    }
    if (constraint_) constraint_->project_params(params_);
    zero_grad();
    return norm;
  }
  const double bc1 = 1.0 - std::pow(opt_.beta1, static_cast<double>(t_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(opt_.beta2, static_cast<double>(t_)));
  const double step_size = lr / bc1;
  for (size_t i : live) {
    // .data(): same storage, its own version counter (see the header).
    torch::Tensor p = params_[i].second.data();
    const torch::Tensor& g = params_[i].second.grad();
    if (decay_[i] && opt_.weight_decay != 0) p.mul_(1.0 - lr * opt_.weight_decay);
    m_[i].mul_(opt_.beta1).add_(g, 1.0 - opt_.beta1);
    v_[i].mul_(opt_.beta2).addcmul_(g, g, 1.0 - opt_.beta2);
    torch::Tensor denom = (v_[i].sqrt() / bc2_sqrt).add_(opt_.eps);
    p.addcdiv_(m_[i], denom, -step_size);
  }
  if (constraint_) constraint_->project_params(params_);
  zero_grad();
  return norm;
}

void AdamW::zero_grad() {
  for (auto& np : params_) {
    if (np.second.grad().defined()) np.second.mutable_grad() = torch::Tensor();
  }
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.reserve(2 * params_.size() + 1);
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].first + ".exp_avg", m_[i].clone());
    out.emplace_back(params_[i].first + ".exp_avg_sq", v_[i].clone());
  }
  out.emplace_back("step", torch::full({}, t_, torch::kLong));
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, torch::Tensor>>& state) {
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& kv : state) by_name[kv.first] = kv.second;
  auto find = [&](const std::string& name, torch::IntArrayRef shape) -> const torch::Tensor& {
    auto it = by_name.find(name);
    if (it == by_name.end() || !it->second.defined())
      throw InputError("optimizer state lacks \"" + name + "\"");
    if (it->second.sizes() != shape)
      throw InputError("optimizer state \"" + name + "\" has the wrong shape");
    return it->second;
  };
  const torch::Tensor& step = find("step", {});
  const int64_t t = step.item<int64_t>();
  if (t < 0) throw InputError("optimizer state \"step\" is negative");
  // Check everything before changing anything: a bad state leaves this optimizer as it was.
  for (size_t i = 0; i < params_.size(); ++i) {
    find(params_[i].first + ".exp_avg", m_[i].sizes());
    find(params_[i].first + ".exp_avg_sq", v_[i].sizes());
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    m_[i].copy_(find(params_[i].first + ".exp_avg", m_[i].sizes()));
    v_[i].copy_(find(params_[i].first + ".exp_avg_sq", v_[i].sizes()));
  }
  t_ = t;
}

}  // namespace swarm
